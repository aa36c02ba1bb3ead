"""Pallas TPU (Mosaic) kernels of the gated gather, forward and token-side backward.

One program handles `block_tokens` tokens. Their row ids sit in SMEM; the program issues one DMA
per (token, slot) row from each table in HBM into VMEM scratch [bt, S, D], waits for all of them,
then dots, gates and sums on the VPU in float32. Only a block's rows are ever resident. The bias
values ([N, S], tiny) are gathered by XLA before the call. Table gradients are the shared
sorted-segment sums (segment_grads.py). Off TPU the kernels run in TPU interpret mode. Pallas TPU does
not lower erfc (exact GELU), so the activation runs through kernel_math.lowerable.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _interpret(options):
  if jax.default_backend() == "tpu" and not options.interpret:
    return False
  return pltpu.InterpretParams()


def _gather_rows(rows_smem, tables_hbm, scratch, sem, bt, S):
  """DMA rows[t, s] of each table into scratch[k][t, s] for the block; returns when all landed."""

  def copies(j):
    t, s = j // S, j % S
    r = rows_smem[t, s]
    return [
      pltpu.make_async_copy(table.at[pl.ds(r, 1)], buf.at[t, pl.ds(s, 1)], sem.at[k])
      for k, (table, buf) in enumerate(zip(tables_hbm, scratch))
    ]

  def start(j, carry):
    for c in copies(j):
      c.start()
    return carry

  def wait(j, carry):
    for c in copies(j):
      c.wait()
    return carry

  jax.lax.fori_loop(0, bt * S, start, 0)
  jax.lax.fori_loop(0, bt * S, wait, 0)


def _pad_tokens(arrays, bt):
  n = arrays[0].shape[0]
  pad = -(-n // bt) * bt - n
  return [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays]


def _specs(bt, S, D, n_slot_inputs):
  token = pl.BlockSpec((bt, D), lambda i: (i, 0))
  slot = pl.BlockSpec((bt, S), lambda i: (i, 0))
  rows = pl.BlockSpec((bt, S), lambda i: (i, 0), memory_space=pltpu.SMEM)
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  return token, slot, [rows, token] + [slot] * n_slot_inputs + [hbm, hbm]


def forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  n_tokens, D = x_ND.shape
  S = rows_NS.shape[1]
  bt = options.block_tokens
  dtype = x_ND.dtype
  bias_NS = jnp.zeros(rows_NS.shape, jnp.float32) if bias_R is None else bias_R[rows_NS].astype(jnp.float32)
  x_ND, rows_NS, gates_NS, bias_NS = _pad_tokens([x_ND, rows_NS, gates_NS, bias_NS], bt)
  n_padded = x_ND.shape[0]
  gating = gating.lowered()

  def kernel(rows_smem, x_ref, gates_ref, bias_ref, w_in_hbm, w_out_hbm, y_ref, h_ref, w_in_v, w_out_v, sem):
    _gather_rows(rows_smem, (w_in_hbm, w_out_hbm), (w_in_v, w_out_v), sem, bt, S)
    x_bD = x_ref[...].astype(jnp.float32)
    w_in_bSD = w_in_v[...].astype(dtype).astype(jnp.float32)
    h_bS = jnp.sum(x_bD[:, None, :] * w_in_bSD, axis=-1) + bias_ref[...]
    h_ref[...] = h_bS
    a_bS = gating.value(h_bS, gates_ref[...].astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    w_out_bSD = w_out_v[...].astype(dtype).astype(jnp.float32)
    y_ref[...] = jnp.sum(a_bS[:, :, None] * w_out_bSD, axis=1).astype(y_ref.dtype)

  token, slot, in_specs = _specs(bt, S, D, 2)
  y_ND, h_NS = pl.pallas_call(
    kernel,
    grid=(n_padded // bt,),
    in_specs=in_specs,
    out_specs=[token, slot],
    out_shape=[jax.ShapeDtypeStruct((n_padded, D), dtype), jax.ShapeDtypeStruct((n_padded, S), jnp.float32)],
    scratch_shapes=[
      pltpu.VMEM((bt, S, D), w_in_RD.dtype),
      pltpu.VMEM((bt, S, D), w_out_RD.dtype),
      pltpu.SemaphoreType.DMA((2,)),
    ],
    interpret=_interpret(options),
    name="gated_gather_forward",
  )(rows_NS, x_ND, gates_NS, bias_NS, w_in_RD, w_out_RD)
  return y_ND[:n_tokens], h_NS[:n_tokens]


def backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
  """dx [N, D], dgates, coef_in = dL/dh and coef_out = a(h, gate) ([N, S] float32)."""
  n_tokens, D = dy_ND.shape
  S = rows_NS.shape[1]
  bt = options.block_tokens
  dtype = dy_ND.dtype
  dy_ND, rows_NS, gates_NS, h_NS = _pad_tokens([dy_ND, rows_NS, gates_NS, h_NS], bt)
  n_padded = dy_ND.shape[0]
  gating = gating.lowered()

  def kernel(
    rows_smem,
    dy_ref,
    gates_ref,
    h_ref,
    w_in_hbm,
    w_out_hbm,
    dx_ref,
    dgates_ref,
    cin_ref,
    cout_ref,
    w_in_v,
    w_out_v,
    sem,
  ):
    _gather_rows(rows_smem, (w_in_hbm, w_out_hbm), (w_in_v, w_out_v), sem, bt, S)
    dy_bD = dy_ref[...].astype(jnp.float32)
    dyw_bS = jnp.sum(dy_bD[:, None, :] * w_out_v[...].astype(dtype).astype(jnp.float32), axis=-1)
    h_bS = h_ref[...]
    gates_bS = gates_ref[...].astype(jnp.float32)
    a_bS, da_dh_bS, da_dg_bS = gating.value_and_slopes(h_bS, gates_bS)
    coef_in_bS = da_dh_bS * dyw_bS
    dgates_ref[...] = da_dg_bS * dyw_bS
    cin_ref[...] = coef_in_bS
    cout_ref[...] = a_bS
    c_bS = coef_in_bS.astype(dtype).astype(jnp.float32)
    dx_ref[...] = jnp.sum(c_bS[:, :, None] * w_in_v[...].astype(dtype).astype(jnp.float32), axis=1).astype(dx_ref.dtype)

  token, slot, in_specs = _specs(bt, S, D, 2)
  slot_out = jax.ShapeDtypeStruct((n_padded, S), jnp.float32)
  dx_ND, dgates, cin, cout = pl.pallas_call(
    kernel,
    grid=(n_padded // bt,),
    in_specs=in_specs,
    out_specs=[token, slot, slot, slot],
    out_shape=[jax.ShapeDtypeStruct((n_padded, D), dtype), slot_out, slot_out, slot_out],
    scratch_shapes=[
      pltpu.VMEM((bt, S, D), w_in_RD.dtype),
      pltpu.VMEM((bt, S, D), w_out_RD.dtype),
      pltpu.SemaphoreType.DMA((2,)),
    ],
    interpret=_interpret(options),
    name="gated_gather_backward",
  )(rows_NS, dy_ND, gates_NS, h_NS, w_in_RD, w_out_RD)
  return dx_ND[:n_tokens], dgates[:n_tokens], cin[:n_tokens], cout[:n_tokens]
