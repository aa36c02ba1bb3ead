"""Pallas GPU kernels of the gated gather (Triton lowering), forward and token-side backward.

One program handles `block_tokens` tokens and walks their S slots: per slot it gathers the block's
w_in and w_out rows straight from the tables in HBM (one row per token, no [tokens, S, D] copy),
dots, gates and accumulates in float32 registers. Per-slot arrays travel transposed ([S, N]) so a
slot is a contiguous row of the block. The table gradients are the shared sorted-segment sums
(segment_grads.py).

Mosaic GPU (mosaic_gpu.py) is the kernel for Hopper and newer; this Triton lowering, still supported by the
pinned JAX (0.10.x), serves older GPUs (A100) and `kernel.gpu_kernel=triton`, and off GPU its generic
interpreter is the fast way to check a Pallas path on CPU. A per-token row gather is an indexed pointer load
here, so no TMA row copies are needed.

The calls pass Triton compiler params explicitly: in JAX 0.10 a `pl.pallas_call` without them is lowered
by Mosaic GPU (`jax_pallas_use_mosaic_gpu` defaults to True), which would stage the whole tables into
shared memory. Triton lowers neither erf nor erfc, so the activation runs through kernel_math.lowerable.

Triton needs power-of-two block shapes: S and the block of tokens are padded here (padding slots
have gate 0 and contribute nothing); D must be a power of two on GPU (interpret mode takes any D).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _next_pow2(n):
  return 1 << max(0, (n - 1).bit_length())


def _layout(x_ND, rows_NS, per_slot, block_tokens):
  """Pads tokens to the block, S to a power of two; per-slot arrays are transposed to [S, N]."""
  n_tokens, S = rows_NS.shape
  n_padded = -(-n_tokens // block_tokens) * block_tokens
  s_padded = _next_pow2(S)
  pad_tokens = n_padded - n_tokens
  x_ND = jnp.pad(x_ND, ((0, pad_tokens), (0, 0)))
  slots = [jnp.pad(a, ((0, pad_tokens), (0, s_padded - S))).T for a in (rows_NS,) + tuple(per_slot)]
  return x_ND, slots, n_padded, s_padded


def _interpret():
  return jax.default_backend() != "gpu"


def forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  n_tokens, D = x_ND.shape
  S = rows_NS.shape[1]
  bt = _next_pow2(options.block_tokens)
  x_ND, (rows_SN, gates_SN), n_padded, s_padded = _layout(x_ND, rows_NS, (gates_NS,), bt)
  has_bias = bias_R is not None
  bias_R1 = (bias_R if has_bias else jnp.zeros((1,), jnp.float32)).reshape(-1, 1)
  dtype = x_ND.dtype
  gating = gating.lowered()

  def kernel(x_ref, rows_ref, gates_ref, w_in_ref, w_out_ref, bias_ref, y_ref, h_ref):
    x_bD = x_ref[...]

    def slot(s, y_bD):
      rows_b = rows_ref[s, :]
      w_in_bD = w_in_ref[rows_b, :].astype(dtype)
      h_b = jnp.sum(x_bD.astype(jnp.float32) * w_in_bD.astype(jnp.float32), axis=1)
      if has_bias:
        h_b = h_b + bias_ref[rows_b, 0].astype(jnp.float32)
      h_ref[s, :] = h_b
      a_b = gating.value(h_b, gates_ref[s, :].astype(jnp.float32)).astype(dtype)
      w_out_bD = w_out_ref[rows_b, :].astype(dtype)
      return y_bD + a_b.astype(jnp.float32)[:, None] * w_out_bD.astype(jnp.float32)

    y_ref[...] = jax.lax.fori_loop(0, s_padded, slot, jnp.zeros((bt, D), jnp.float32)).astype(y_ref.dtype)

  token_block = pl.BlockSpec((bt, D), lambda i: (i, 0))
  slot_block = pl.BlockSpec((s_padded, bt), lambda i: (0, i))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  y_ND, h_SN = pl.pallas_call(
    kernel,
    grid=(n_padded // bt,),
    in_specs=[token_block, slot_block, slot_block, whole(w_in_RD), whole(w_out_RD), whole(bias_R1)],
    out_specs=[token_block, slot_block],
    out_shape=[jax.ShapeDtypeStruct((n_padded, D), dtype), jax.ShapeDtypeStruct((s_padded, n_padded), jnp.float32)],
    interpret=_interpret() or options.interpret,
    compiler_params=pltriton.CompilerParams(),
    name="gated_gather_forward",
  )(x_ND, rows_SN, gates_SN, w_in_RD, w_out_RD, bias_R1)
  return y_ND[:n_tokens], h_SN.T[:n_tokens, :S]


def backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
  """dx [N, D], dgates, coef_in = dL/dh and coef_out = a(h, gate) ([N, S] float32)."""
  n_tokens, D = dy_ND.shape
  S = rows_NS.shape[1]
  bt = _next_pow2(options.block_tokens)
  dy_ND, (rows_SN, gates_SN, h_SN), n_padded, s_padded = _layout(dy_ND, rows_NS, (gates_NS, h_NS), bt)
  dtype = dy_ND.dtype
  gating = gating.lowered()

  def kernel(dy_ref, rows_ref, gates_ref, h_ref, w_in_ref, w_out_ref, dx_ref, dgates_ref, cin_ref, cout_ref):
    dy_bD = dy_ref[...].astype(jnp.float32)

    def slot(s, dx_bD):
      rows_b = rows_ref[s, :]
      w_out_bD = w_out_ref[rows_b, :].astype(dtype).astype(jnp.float32)
      dyw_b = jnp.sum(dy_bD * w_out_bD, axis=1)
      h_b = h_ref[s, :]
      gates_b = gates_ref[s, :].astype(jnp.float32)
      a_b, da_dh_b, da_dg_b = gating.value_and_slopes(h_b, gates_b)
      coef_in_b = da_dh_b * dyw_b
      dgates_ref[s, :] = da_dg_b * dyw_b
      cin_ref[s, :] = coef_in_b
      cout_ref[s, :] = a_b
      w_in_bD = w_in_ref[rows_b, :].astype(dtype).astype(jnp.float32)
      return dx_bD + coef_in_b.astype(dtype).astype(jnp.float32)[:, None] * w_in_bD

    dx_ref[...] = jax.lax.fori_loop(0, s_padded, slot, jnp.zeros((bt, D), jnp.float32)).astype(dx_ref.dtype)

  token_block = pl.BlockSpec((bt, D), lambda i: (i, 0))
  slot_block = pl.BlockSpec((s_padded, bt), lambda i: (0, i))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
  slot_out = jax.ShapeDtypeStruct((s_padded, n_padded), jnp.float32)
  dx_ND, dgates_SN, cin_SN, cout_SN = pl.pallas_call(
    kernel,
    grid=(n_padded // bt,),
    in_specs=[token_block, slot_block, slot_block, slot_block, whole(w_in_RD), whole(w_out_RD)],
    out_specs=[token_block, slot_block, slot_block, slot_block],
    out_shape=[jax.ShapeDtypeStruct((n_padded, D), dtype), slot_out, slot_out, slot_out],
    interpret=_interpret() or options.interpret,
    compiler_params=pltriton.CompilerParams(),
    name="gated_gather_backward",
  )(dy_ND, rows_SN, gates_SN, h_SN, w_in_RD, w_out_RD)
  crop = lambda a_SN: a_SN.T[:n_tokens, :S]
  return dx_ND[:n_tokens], crop(dgates_SN), crop(cin_SN), crop(cout_SN)
