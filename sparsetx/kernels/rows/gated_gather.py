"""The gated gather shared by sgatlin, PEER and FFF, as one op with a custom VJP.

  y[t] = sum_s a(h[t, s], gates[t, s]) * w_out[rows[t, s]],  h[t, s] = <w_in[rows[t, s]], x[t]> + bias[rows[t, s]]

where the slot coefficient a is act(g * h) with `gate_inside_activation=True` (sgatlin's official code) or
g * act(h) with False (PEER; FFF: gates 1); reference.Gating holds the choice and the slopes every backward
uses. With `sum_axes` (the d-split) x and the tables are d-slices whose partial dots are summed over those axes.

More: docs/modules.md, sparsetx/kernels/rows/gated_gather.py.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsetx import scopes
from sparsetx.kernels import op_calls, platform, registry
from sparsetx.kernels.options import KernelOptions, options_from_config  # noqa: F401 (API)
from sparsetx.kernels.rows import segment_grads, sliced_gather, xla_gather
from sparsetx.kernels.rows.reference import Gating, gated_gather_reference, identity
from sparsetx.kernels.rows.row_gather import stream_dtype


class TableDtypes(NamedTuple):
  """The tables' parameter dtype (their gradients') and the dtype the kernels read them in (static)."""

  param: jnp.dtype
  stream: jnp.dtype


class TokenResiduals(NamedTuple):
  x_ND: jax.Array
  w_in_RD: jax.Array  # the streamed copies: the backward does not cast again
  w_out_RD: jax.Array
  rows_NS: jax.Array
  gates_NS: jax.Array
  bias_R: jax.Array | None
  h_NS: jax.Array  # the float32 pre-activations
  h_given_NS: jax.Array | None


class RowResiduals(NamedTuple):
  x_ND: jax.Array
  w_in_RD: jax.Array
  w_out_RD: jax.Array
  rows_NS: jax.Array
  gates_NS: jax.Array
  bias_R: jax.Array | None
  order: xla_gather.RowOrder  # the pairs sorted by row, once
  h_P: jax.Array  # the float32 pre-activations in that order


class SliceResiduals(NamedTuple):
  x_hd: jax.Array
  w_in_Rd: jax.Array
  w_out_Rd: jax.Array
  rows_hS: jax.Array
  gates_hS: jax.Array
  h_hS: jax.Array


def _cotangents(table_dtype, x_ND, rows_NS, gates_NS, bias_R, dx_ND, dgates_NS, dw_in, dw_out, dbias, h_given_NS=None):
  """The custom VJP's cotangents, each in its primal's dtype (the tables' in their parameter dtype)."""
  return (
    dx_ND.astype(x_ND.dtype),
    dw_in.astype(table_dtype.param),
    dw_out.astype(table_dtype.param),
    jnp.zeros(rows_NS.shape, jax.dtypes.float0),
    dgates_NS.astype(gates_NS.dtype),
    None if bias_R is None else dbias.astype(bias_R.dtype),
    None if h_given_NS is None else jnp.zeros_like(h_given_NS),  # given pre-activations carry no gradient
  )


@dataclasses.dataclass(frozen=True)
class TokenOrder:
  """Each token's slots in token order: the implementation's forward and backward over the rows, then the tables'
  sums of the pairs sorted by row (segment_grads.py)."""

  def primal(self, impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
    return self.forward(impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS)[0]

  def forward(self, impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
    """(y [N, D], TokenResiduals) of the streamed tables."""
    with jax.named_scope(scopes.ROW_GATHER):
      if h_given_NS is not None:
        y_ND = impl.forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_given_NS, gating, options)
        h_NS = h_given_NS
      else:
        y_ND, h_NS = impl.forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)
    return y_ND, TokenResiduals(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_NS, h_given_NS)

  def backward(self, impl, gating, options, table_dtype, res: TokenResiduals, dy_ND):
    dy_ND = dy_ND.astype(res.x_ND.dtype)
    with jax.named_scope(scopes.ROW_GATHER):
      dx_ND, dgates_NS, coef_in_NS, coef_out_NS = impl.backward_rows(
        dy_ND, res.h_NS, res.w_in_RD, res.w_out_RD, res.rows_NS, res.gates_NS, gating, options
      )
    n_rows, with_bias = res.w_in_RD.shape[0], res.bias_R is not None
    grads = segment_grads.table_grads(
      impl, res.x_ND, dy_ND, res.rows_NS, coef_in_NS, coef_out_NS, n_rows, options, with_bias
    )
    like = (res.x_ND, res.rows_NS, res.gates_NS, res.bias_R)
    return _cotangents(table_dtype, *like, dx_ND, dgates_NS, *grads, res.h_given_NS)


@dataclasses.dataclass(frozen=True)
class RowSorted:
  """The CPU's one walk in row order for a step that differentiates (xla_gather.row_sorted_*): the pairs sorted
  by row once, rows and tables together. Without a backward pass the sort does not pay for itself (the
  row-sorted forward alone is 0-8% slower), so the primal is token order's."""

  def primal(self, impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
    return TokenOrder().primal(impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS)

  def forward(self, impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
    del impl, h_given_NS  # XLA's form, and never for given pre-activations (FFF has its own walk)
    order = xla_gather.row_order(rows_NS, gates_NS, w_in_RD.shape[0], options.pair_chunk, gating.linear_in_gate)
    with jax.named_scope(scopes.ROW_GATHER):
      y_ND, h_P = xla_gather.row_sorted_forward(x_ND, w_in_RD, w_out_RD, order, bias_R, gating, options)
    return y_ND, RowResiduals(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, order, h_P)

  def backward(self, impl, gating, options, table_dtype, res: RowResiduals, dy_ND):
    with jax.named_scope(scopes.ROW_GATHER):  # rows and tables in one pass
      grads = xla_gather.row_sorted_backward(
        dy_ND.astype(res.x_ND.dtype),
        res.x_ND,
        res.h_P,
        res.w_in_RD,
        res.w_out_RD,
        res.order,
        res.bias_R is not None,
        gating,
        options,
      )
    return _cotangents(table_dtype, res.x_ND, res.rows_NS, res.gates_NS, res.bias_R, *grads)


@dataclasses.dataclass(frozen=True)
class DSplit:
  """One device's d-slice of the gated gather (sliced_gather.py): the partial dots summed over `sum_axes`."""

  sum_axes: tuple

  def primal(self, impl, gating, options, *args):
    return self.forward(impl, gating, options, *args)[0]

  def forward(self, impl, gating, options, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, bias_R, h_given_NS):
    del bias_R, h_given_NS  # refused by gated_gather
    with jax.named_scope(scopes.ROW_GATHER):
      y_hd, res = sliced_gather.forward(
        impl, gating, options, self.sum_axes, w_in_Rd.dtype, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS
      )
    return y_hd, SliceResiduals(*res)

  def backward(self, impl, gating, options, table_dtype, res: SliceResiduals, dy_hd):
    with jax.named_scope(scopes.ROW_GATHER):
      dx_hd, dw_in, dw_out, dgates_hS = sliced_gather.backward(impl, gating, options, self.sum_axes, res, dy_hd)
    return _cotangents(table_dtype, res.x_hd, res.rows_hS, res.gates_hS, None, dx_hd, dgates_hS, dw_in, dw_out, None)


def _form(impl, options, sum_axes, x_ND, w_in_RD, h_given):
  """The form this call takes: the d-split where d_model is split, the row order where the implementation walks rows
  (XLA on a CPU, float32: bf16 would round a row picked twice by a token once, not per slot), else token order."""
  if sum_axes:
    return DSplit(sum_axes)
  if (
    options.row_sorted
    and impl.cpu_row_sorted
    and h_given is None
    and platform.on_cpu()  # its scatter-adds into x-sized sums are ordered (deterministic) on a CPU
    and x_ND.dtype == jnp.float32
    and xla_gather.row_sorted_fits(x_ND.shape[0], w_in_RD.shape[0])
  ):
    return RowSorted()
  return TokenOrder()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _gated_gather_ND(
  form, impl, gating, options, table_dtype, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS
):
  w_in_RD, w_out_RD = w_in_RD.astype(table_dtype.stream), w_out_RD.astype(table_dtype.stream)  # one cast per call
  return form.primal(impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS)


def _fwd(form, impl, gating, options, table_dtype, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
  w_in_RD, w_out_RD = w_in_RD.astype(table_dtype.stream), w_out_RD.astype(table_dtype.stream)
  return form.forward(impl, gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS)


def _bwd(form, impl, gating, options, table_dtype, residuals, dy_ND):
  return form.backward(impl, gating, options, table_dtype, residuals, dy_ND)


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
  implementation=None,
):
  """y [B, T, D] in x's dtype; `options` is a KernelOptions (defaults: implementation 'auto'); `implementation`
  (a rows/interface.RowKernels) overrides registry.rows' choice (the autotuner measures each this way).

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
  stream = stream_dtype(x_BTD.dtype, w_in_RD.dtype)
  x_ND = x_BTD.reshape(-1, D)
  h_given_NS = None if pre_activation is None else pre_activation.reshape(-1, S).astype(jnp.float32)
  if implementation is None:  # resolved once per call, passed down to every kernel of both passes
    gate_inside, given_h = bool(gate_inside_activation), pre_activation is not None
    call = op_calls.gather(
      x_ND, w_in_RD, stream, S, activation, gate_inside, bias_R is not None, given_h, bool(sum_axes)
    )
    implementation = registry.rows(options, op_calls.shape_class(call), call)
  y_ND = _gated_gather_ND(
    _form(implementation, options, sum_axes, x_ND, w_in_RD, h_given_NS),
    implementation,
    Gating(activation, bool(gate_inside_activation)),
    options,
    TableDtypes(jnp.dtype(w_in_RD.dtype), stream),
    x_ND,
    w_in_RD,
    w_out_RD,
    rows_BTS.reshape(-1, S).astype(jnp.int32),
    gates_BTS.reshape(-1, S),
    bias_R,
    h_given_NS,
  )
  return y_ND.reshape(*lead, D)


__all__ = [
  "gated_gather",
  "gated_gather_reference",
  "Gating",
  "KernelOptions",
  "options_from_config",
]
