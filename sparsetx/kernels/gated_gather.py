"""The gated gather shared by sgatlin, PEER and FFF, as one op with a custom VJP.

  y[t] = sum_s a(h[t, s], gates[t, s]) * w_out[rows[t, s]],  h[t, s] = <w_in[rows[t, s]], x[t]> + bias[rows[t, s]]

where the slot coefficient a is act(g * h) with `gate_inside_activation=True` (the default: sgatlin's
official code applies its ablation activation to the gated pre-activation) or g * act(h) with False (PEER:
softmax scores times GELU'd neurons; FFF: gates 1). reference.Gating holds the choice and the slopes every
backend's backward uses; with the identity activation both forms are the paper's g * h exactly.

Tables are flat `[R, D]`: sgatlin flattens its `(C, d_ffw)` channels into rows `c * d_ffw + i`,
PEER's table is shared so rows are neuron ids, FFF's rows are `tree * n_nodes + node` with the
node bias. Gradients flow to x, both tables, the gates and the bias (through the activation).
Dots and sums accumulate in float32; y and dx have x's dtype. A caller that already holds the
pre-activations (FFF's walk) passes them in, and the XLA forward then gathers only w_out rows.

`options.implementation` picks the backend: `xla` (token-chunked gathers, xla_gather.py),
`pallas` (on GPU mosaic_gpu.py from Hopper on or the Triton lowering pallas_gpu.py, by `options.gpu_kernel`;
pallas_tpu.py on TPU; interpret mode elsewhere) or `auto` (pallas on GPU/TPU, xla on CPU). Every backend shares the deterministic sorted-segment table
gradients (segment_grads.py), except the XLA path's row-sorted variant (`options.row_sorted`, used on CPU
in float32 when gradients are taken), whose forward sorts once and whose backward walks that same order
for every gradient (xla_gather.py). The papers' formulation stays in reference.py.
"""

import functools

import jax
import jax.numpy as jnp

from sparsetx.kernels import segment_grads, token_shards, xla_gather
from sparsetx.kernels.options import GPU_KERNELS, IMPLEMENTATIONS, KernelOptions, options_from_config  # noqa: F401 (API)
from sparsetx.kernels.reference import Gating, gated_gather_reference, identity


def _backend(options: KernelOptions):
  """The module providing forward/backward_rows for this implementation and platform."""
  implementation = options.implementation
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"kernel implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}.")
  platform = jax.default_backend()
  if implementation == "auto":
    implementation = "pallas" if platform in ("gpu", "tpu") else "xla"
  if implementation == "xla":
    return xla_gather
  if platform == "tpu":
    from sparsetx.kernels import pallas_tpu

    return pallas_tpu
  if _gpu_kernel(options, platform) == "mosaic":
    from sparsetx.kernels import mosaic_gpu

    return mosaic_gpu
  from sparsetx.kernels import pallas_gpu  # Triton: GPU, or interpret mode anywhere else

  return pallas_gpu


def _gpu_kernel(options, platform):
  """mosaic on Hopper and newer (sm_90+); triton on older GPUs and, by default, in interpret mode off GPU
  (the generic interpreter is much faster than Mosaic GPU's simulation of TMA and barriers)."""
  choice = options.gpu_kernel
  if choice not in GPU_KERNELS:
    raise ValueError(f"kernel gpu_kernel={choice!r} is unknown; use one of {GPU_KERNELS}.")
  if choice != "auto":
    return choice
  if platform != "gpu":
    return "triton"
  capability = getattr(jax.devices()[0], "compute_capability", "0")
  return "mosaic" if float(capability) >= 9.0 else "triton"


def _row_sorted(options, x_ND, w_in_RD, h_given_NS):
  """Whether this call takes the row-sorted XLA path (not for given pre-activations: FFF has its own walk)."""
  return (
    options.row_sorted
    and h_given_NS is None
    and _backend(options) is xla_gather
    and jax.default_backend() == "cpu"  # its scatter-adds into x-sized sums are ordered (deterministic) on CPU
    and x_ND.dtype == jnp.float32  # bf16 would round a row picked twice by a token once, not per slot
    and xla_gather.row_sorted_fits(x_ND.shape[0], w_in_RD.shape[0])
  )


def _forward_impl(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS, for_backward):
  backend = _backend(options)
  if for_backward and _row_sorted(options, x_ND, w_in_RD, h_given_NS):
    order = xla_gather.row_order(rows_NS, gates_NS, w_in_RD.shape[0], options.pair_chunk, gating.linear_in_gate)
    y_ND, h_P = xla_gather.row_sorted_forward(x_ND, w_in_RD, w_out_RD, order, bias_R, gating, options)
    return y_ND, (order, h_P)
  if h_given_NS is not None and hasattr(backend, "forward_from_pre_activation"):
    y_ND = _per_token(
      backend,
      backend.forward_from_pre_activation,
      gating,
      options,
      (True, False, True, True, True),
      x_ND,
      w_out_RD,
      rows_NS,
      gates_NS,
      h_given_NS,
    )
    return y_ND, h_given_NS
  return _per_token(
    backend,
    backend.forward,
    gating,
    options,
    (True, False, False, True, True, False),
    x_ND,
    w_in_RD,
    w_out_RD,
    rows_NS,
    gates_NS,
    bias_R,
  )


def _per_token(backend, fn, gating, options, per_token, *args):
  """fn(*args, gating, options); a Pallas backend's kernels run on each device's own tokens (token_shards.py)."""
  call = lambda *a: fn(*a, gating, options)  # noqa: E731
  return call(*args) if backend is xla_gather else token_shards.on_token_shards(call, per_token, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gated_gather_ND(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
  # Without a backward pass the sort does not pay for itself (the row-sorted forward alone is 0-8% slower).
  return _forward_impl(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS, False)[0]


def _fwd(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS):
  y_ND, h_NS = _forward_impl(gating, options, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_given_NS, True)
  return y_ND, (x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_NS, h_given_NS)


def _bwd(gating, options, residuals, dy_ND):
  x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, h_NS, h_given_NS = residuals
  backend = _backend(options)
  dy_ND = dy_ND.astype(x_ND.dtype)
  if _row_sorted(options, x_ND, w_in_RD, h_given_NS):
    order, h_P = h_NS  # the row-sorted forward keeps its sort and the sorted pre-activations
    dx_ND, dgates_NS, dw_in, dw_out, dbias = xla_gather.row_sorted_backward(
      dy_ND, x_ND, h_P, w_in_RD, w_out_RD, order, bias_R is not None, gating, options
    )
  else:
    dx_ND, dgates_NS, coef_in_NS, coef_out_NS = _per_token(
      backend,
      backend.backward_rows,
      gating,
      options,
      (True, True, False, False, True, True),
      dy_ND,
      h_NS,
      w_in_RD,
      w_out_RD,
      rows_NS,
      gates_NS,
    )
    dw_in, dw_out, dbias = segment_grads.table_grads(
      x_ND, dy_ND, rows_NS, coef_in_NS, coef_out_NS, w_in_RD.shape[0], options.pair_chunk, bias_R is not None
    )
  rows_cotangent = jax.numpy.zeros(rows_NS.shape, jax.dtypes.float0)
  return (
    dx_ND.astype(x_ND.dtype),
    dw_in.astype(w_in_RD.dtype),
    dw_out.astype(w_out_RD.dtype),
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
):
  """y [B, T, D] in x's dtype; `options` is a KernelOptions (defaults: implementation 'auto').

  `gate_inside_activation` (static): act(g * h) when True (sgatlin, its official code), g * act(h) when
  False (PEER, FFF); see the module docstring.

  `pre_activation` [B, T, S] (float32), when the caller already has <w_in[rows], x> + bias[rows] (FFF's
  walk computes exactly these logits), spares the XLA forward its w_in gather. It must equal those
  values; gradients still reach x, w_in and bias as if computed here, and it gets none of its own.
  """
  options = KernelOptions() if options is None else options
  *lead, D = x_BTD.shape
  S = rows_BTS.shape[-1]
  y_ND = _gated_gather_ND(
    Gating(activation, bool(gate_inside_activation)),
    options,
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
