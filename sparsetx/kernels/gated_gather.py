"""The gated gather shared by sgatlin, PEER and FFF, as one op with a custom VJP.

  y[t] = sum_s a(h[t, s], gates[t, s]) * w_out[rows[t, s]],  h[t, s] = <w_in[rows[t, s]], x[t]> + bias[rows[t, s]]

where the slot coefficient a is act(g * h) with `gate_inside_activation=True` (sgatlin's official code) or
g * act(h) with False (PEER; FFF: gates 1); reference.Gating holds the choice and the slopes every backward
uses. With `sum_axes` (the d-split) x and the tables are d-slices whose partial dots are summed over those axes.

More: docs/modules.md, sparsetx/kernels/gated_gather.py.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsetx import scopes
from sparsetx.kernels import platform, row_gather, segment_grads, sliced_gather, xla_gather
from sparsetx.kernels.options import GPU_KERNELS, IMPLEMENTATIONS, KernelOptions, options_from_config  # noqa: F401 (API)
from sparsetx.kernels.reference import Gating, gated_gather_reference, identity


def stream_dtype(x_dtype, table_dtype):
  """The dtype a table's rows are read in: x's when it is the narrower float (a bf16 run), else the table's."""
  x_dtype, table_dtype = jnp.dtype(x_dtype), jnp.dtype(table_dtype)
  return x_dtype if x_dtype.itemsize < table_dtype.itemsize else table_dtype


class TableDtypes(NamedTuple):
  """The tables' parameter dtype (their gradients') and the dtype the kernels read them in (static)."""

  param: jnp.dtype
  stream: jnp.dtype


def _row_sorted(options, x_ND, w_in_RD, h_given_NS):
  """Whether this call takes the row-sorted XLA path (not for given pre-activations: FFF has its own walk)."""
  return (
    options.row_sorted
    and h_given_NS is None
    and platform.kernel_backend(options) is None
    and platform.on_cpu()  # its scatter-adds into x-sized sums are ordered (deterministic) on CPU
    and x_ND.dtype == jnp.float32  # bf16 would round a row picked twice by a token once, not per slot
    and xla_gather.row_sorted_fits(x_ND.shape[0], w_in_RD.shape[0])
  )


def _ops(options):
  """(forward, forward_from_pre_activation, backward_rows) of this call's backend."""
  backend = platform.kernel_backend(options)
  if backend is None:
    return xla_gather.forward, xla_gather.forward_from_pre_activation, xla_gather.backward_rows
  bind = lambda fn: functools.partial(fn, backend)  # noqa: E731
  return bind(row_gather.forward), bind(row_gather.forward_from_pre_activation), bind(row_gather.backward_rows)


def _forward_impl(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS, for_backward):
  if for_backward and _row_sorted(options, x_ND, w_in_RD, h_given_NS):
    order = xla_gather.row_order(rows_NS, gates_NS, w_in_RD.shape[0], options.pair_chunk, gating.linear_in_gate)
    y_ND, h_P = xla_gather.row_sorted_forward(x_ND, w_in_RD, w_out_RD, order, bias_R, gating, options)
    return y_ND, (order, h_P)
  forward, from_pre_activation, _ = _ops(options)
  if h_given_NS is not None:
    return from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_given_NS, gating, options), h_given_NS
  return forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gated_gather_ND(
  gating, options, table_dtype, sum_axes, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS
):
  if sum_axes:
    args = (x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS)
    return sliced_gather.forward(gating, options, sum_axes, table_dtype.stream, *args)[0]
  # Without a backward pass the sort does not pay for itself (the row-sorted forward alone is 0-8% slower).
  w_in_RD, w_out_RD = w_in_RD.astype(table_dtype.stream), w_out_RD.astype(table_dtype.stream)  # one cast per call
  with jax.named_scope(scopes.ROW_GATHER):
    return _forward_impl(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS, False)[0]


def _fwd(gating, options, table_dtype, sum_axes, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
  if sum_axes:  # the d-split keeps its own residuals (sliced_gather.forward)
    with jax.named_scope(scopes.ROW_GATHER):
      return sliced_gather.forward(
        gating, options, sum_axes, table_dtype.stream, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS
      )
  # The streamed copies are the residuals: the backward does not cast again.
  w_in_RD, w_out_RD = w_in_RD.astype(table_dtype.stream), w_out_RD.astype(table_dtype.stream)
  with jax.named_scope(scopes.ROW_GATHER):
    y_ND, h_NS = _forward_impl(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS, True)
  return y_ND, (x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_NS, h_given_NS)


def _backward(gating, options, residuals, dy_ND):
  """(dx, dgates, dW_in, dW_out, dbias) of the fused forward's residuals."""
  x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_NS, h_given_NS = residuals
  dy_ND = dy_ND.astype(x_ND.dtype)
  if _row_sorted(options, x_ND, w_in_RD, h_given_NS):
    order, h_P = h_NS  # the row-sorted forward keeps its sort and the sorted pre-activations
    with jax.named_scope(scopes.ROW_GATHER):  # the CPU's one walk in row order: rows and tables together
      return xla_gather.row_sorted_backward(
        dy_ND, x_ND, h_P, w_in_RD, w_out_RD, order, bias_R is not None, gating, options
      )
  _, _, backward_rows = _ops(options)
  with jax.named_scope(scopes.ROW_GATHER):
    dx_ND, dgates_NS, coef_in_NS, coef_out_NS = backward_rows(
      dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options
    )
  dw_in, dw_out, dbias = segment_grads.table_grads(
    x_ND, dy_ND, rows_NS, coef_in_NS, coef_out_NS, w_in_RD.shape[0], options, bias_R is not None
  )
  return dx_ND, dgates_NS, dw_in, dw_out, dbias


def _bwd(gating, options, table_dtype, sum_axes, residuals, dy_ND):
  if sum_axes:  # sliced_gather.forward's residuals: (x, w_in, w_out, rows, gates, h)
    x_ND, rows_NS, gates_NS = residuals[0], residuals[3], residuals[4]
    bias_R = h_given_NS = dbias = None
    with jax.named_scope(scopes.ROW_GATHER):
      dx_ND, dw_in, dw_out, dgates_NS = sliced_gather.backward(gating, options, sum_axes, residuals, dy_ND)
  else:
    dx_ND, dgates_NS, dw_in, dw_out, dbias = _backward(gating, options, residuals, dy_ND)
    x_ND, rows_NS, gates_NS, bias_R, h_given_NS = (residuals[i] for i in (0, 3, 4, 5, 7))
  rows_cotangent = jax.numpy.zeros(rows_NS.shape, jax.dtypes.float0)
  return (
    dx_ND.astype(x_ND.dtype),
    dw_in.astype(table_dtype.param),
    dw_out.astype(table_dtype.param),
    rows_cotangent,
    dgates_NS.astype(gates_NS.dtype),
    None if bias_R is None else dbias.astype(bias_R.dtype),
    None
    if h_given_NS is None
    else jnp.zeros_like(h_given_NS),  # the given pre-activations carry no gradient of their own
  )


_gated_gather_ND.defvjp(_fwd, _bwd)


def gated_gather(
  x_BTD,
  w_in_RD,
  w_out_RD,
  rows_BTS,
  gates_BTS,
  activation=identity,
  bias_R=None,
  options=None,
  pre_activation=None,
  gate_inside_activation=True,
  sum_axes=(),
):
  """y [B, T, D] in x's dtype; `options` is a KernelOptions (defaults: implementation 'auto').

  `gate_inside_activation` (static): act(g * h) when True (sgatlin, its official code), g * act(h) when
  False (PEER, FFF); see the module docstring.

  `pre_activation` [B, T, S] (float32), when the caller already has <w_in[rows], x> + bias[rows] (FFF's
  walk computes exactly these logits), spares the XLA forward its w_in gather. It must equal those
  values; gradients still reach x, w_in and bias as if computed here, and it gets none of its own.

  `sum_axes` (static; the d-split, inside a shard_map manual over them): x, w_in and w_out are this device's
  d-slices, rows and gates whole; the partial dots are summed over these mesh axes before the activation and the
  gate, and y is this device's d-slice in float32 (partial sums a unit split adds before rounding). The gates'
  gradient is this slice's share, which the transpose of the gates' gather over the d-group sums.
  """
  options = KernelOptions() if options is None else options
  sum_axes = tuple(sum_axes)
  if sum_axes and (bias_R is not None or pre_activation is not None or options.implementation == "reference"):
    raise ValueError("gated_gather: sum_axes (the d-split) takes no bias, pre_activation or reference form.")
  *lead, D = x_BTD.shape
  S = rows_BTS.shape[-1]
  if options.implementation == "reference":  # the papers' formulation (Listing 1), kept for comparison
    as_1TS = lambda a: a.reshape(1, -1, a.shape[-1])  # noqa: E731  (any leading shape: [N, ...] on a device's tokens)
    y_1TD = gated_gather_reference(
      as_1TS(x_BTD), w_in_RD, w_out_RD, as_1TS(rows_BTS), as_1TS(gates_BTS), activation, bias_R, gate_inside_activation
    )
    return y_1TD.reshape(*lead, D)
  y_ND = _gated_gather_ND(
    Gating(activation, bool(gate_inside_activation)),
    options,
    TableDtypes(jnp.dtype(w_in_RD.dtype), stream_dtype(x_BTD.dtype, w_in_RD.dtype)),
    sum_axes,
    x_BTD.reshape(-1, D),
    w_in_RD,
    w_out_RD,
    rows_BTS.reshape(-1, S).astype(jnp.int32),
    gates_BTS.reshape(-1, S),
    bias_R,
    None if pre_activation is None else pre_activation.reshape(-1, S).astype(jnp.float32),
  )
  return y_ND.reshape(*lead, D)


__all__ = [
  "gated_gather",
  "gated_gather_reference",
  "Gating",
  "KernelOptions",
  "options_from_config",
  "IMPLEMENTATIONS",
]
