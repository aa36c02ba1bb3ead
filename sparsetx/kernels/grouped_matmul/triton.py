"""The grouped matmul as Pallas Triton kernels: GPUs before Hopper (A100), float32 on any GPU, and the fast
interpreter for tests on a CPU. Same contract as grouped_xla.py.

gmm: one program per (row tile, output column block). The tile's group and row range come from
group_tiles.row_tiles, so a program multiplies one group's rows by that group's matrix and stores only those
rows (a masked store): no group touches another's rows, and a block shared by two groups is visited twice,
once per group. tgmm: one program per (group, output tile) walks the group's rows in GROUP_STEP-row steps, a
loop whose trip count is the group's own size; an empty group writes zeros.

More: docs/modules.md, sparsetx/kernels/grouped_matmul/triton.py.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from sparsetx.kernels import device
from sparsetx.kernels.grouped_matmul.tiles import n_tiles, row_tiles

GROUP_STEP = 32  # tgmm: rows of a group added per loop step
CHUNK = 64  # the largest K or N chunk of one dot


def _chunk(n: int) -> int:
  """The largest power of two <= CHUNK dividing n (a multiple of 16: a Triton dot's smallest side)."""
  chunk = CHUNK
  while n % chunk:
    chunk //= 2
  return chunk


def _pad16(a, axis):
  """a zero-padded along axis to a multiple of 16."""
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, -a.shape[axis] % 16)
  return jnp.pad(a, widths)


def _dot(a, b, trans_a=False, trans_b=False):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def gmm(lhs_SK, rhs_EKN, group_sizes_E, transpose_rhs, options):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[group(s)] (rhs[group(s)].T with transpose_rhs), float32 sums; rows after
  the last group are zeros."""
  n_rows, n_out = lhs_SK.shape[0], rhs_EKN.shape[1 if transpose_rhs else 2]
  lhs_SK = _pad16(lhs_SK, 1)
  rhs_EKN = _pad16(_pad16(rhs_EKN, 1), 2)
  K = lhs_SK.shape[1]
  E = rhs_EKN.shape[0]
  N = rhs_EKN.shape[1 if transpose_rhs else 2]
  dtype = lhs_SK.dtype
  bm, bk, bn = options.group_rows, _chunk(K), _chunk(N)
  n_padded = -(-n_rows // bm) * bm
  lhs_pK = jnp.pad(lhs_SK, ((0, n_padded - n_rows), (0, 0)))

  def kernel(group_ref, block_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref):
    t, j = pl.program_id(0), pl.program_id(1)
    group, block = group_ref[t], block_ref[t]
    rows = block * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)

    def step(c, acc_mn):
      x_mk = lhs_ref[pl.ds(block * bm, bm), pl.ds(c * bk, bk)]
      if transpose_rhs:
        w_nk = rhs_ref[group, pl.ds(j * bn, bn), pl.ds(c * bk, bk)].astype(dtype)
        return acc_mn + _dot(x_mk, w_nk, trans_b=True)
      w_kn = rhs_ref[group, pl.ds(c * bk, bk), pl.ds(j * bn, bn)].astype(dtype)
      return acc_mn + _dot(x_mk, w_kn)

    acc_mn = jax.lax.fori_loop(0, K // bk, step, jnp.zeros((bm, bn), jnp.float32))
    live = (rows >= lo_ref[t]) & (rows < hi_ref[t])
    pltriton.store(out_ref.at[pl.ds(block * bm, bm), pl.ds(j * bn, bn)], acc_mn.astype(dtype), mask=live)

  T = n_tiles(n_rows, E, bm)
  whole_tiles = pl.BlockSpec((T,), lambda t, j: (0,))
  out_pN = pl.pallas_call(
    kernel,
    grid=(T, N // bn),
    in_specs=[whole_tiles] * 4
    + [pl.BlockSpec((n_padded, K), lambda t, j: (0, 0)), pl.BlockSpec(rhs_EKN.shape, lambda t, j: (0, 0, 0))],
    out_specs=pl.BlockSpec((n_padded, N), lambda t, j: (0, 0)),
    out_shape=jax.ShapeDtypeStruct((n_padded, N), dtype),
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="grouped_matmul",
  )(*row_tiles(group_sizes_E, n_rows, bm), lhs_pK, rhs_EKN)
  routed = jnp.arange(n_rows, dtype=jnp.int32)[:, None] < jnp.sum(group_sizes_E)
  return jnp.where(routed, out_pN[:n_rows, :n_out], jnp.zeros((), dtype))  # rows no tile computed were never written


def tgmm(lhs_SK, dout_SN, group_sizes_E, options):
  """[E, K, N] in lhs's dtype: sum over group e's rows s of outer(lhs[s], dout[s]), float32 sums (empty group:
  zeros; rows after the last group are left out)."""
  (n_rows, k_out), n_out = lhs_SK.shape, dout_SN.shape[1]
  lhs_SK, dout_SN = _pad16(lhs_SK, 1), _pad16(dout_SN, 1)
  K, N, E = lhs_SK.shape[1], dout_SN.shape[1], group_sizes_E.shape[0]
  dtype = lhs_SK.dtype
  bk, bn, step_rows = _chunk(K), _chunk(N), GROUP_STEP
  ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
  starts_E = ends_E - group_sizes_E.astype(jnp.int32)

  def kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref):
    e = pl.program_id(0)
    start, end = starts_ref[e], ends_ref[e]
    cols_k = jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    cols_n = jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)

    def step(c, acc_kn):
      rows = start + c * step_rows + jax.lax.broadcasted_iota(jnp.int32, (step_rows, 1), 0)
      live = rows < end
      x_mk = pltriton.load(lhs_ref.at[rows, cols_k], mask=jnp.broadcast_to(live, (step_rows, bk)), other=0)
      g_mn = pltriton.load(dout_ref.at[rows, cols_n], mask=jnp.broadcast_to(live, (step_rows, bn)), other=0)
      return acc_kn + _dot(x_mk.astype(dtype), g_mn.astype(dtype), trans_a=True)

    n_steps = (end - start + step_rows - 1) // step_rows
    out_ref[...] = jax.lax.fori_loop(0, n_steps, step, jnp.zeros((bk, bn), jnp.float32)).astype(dtype)

  whole_groups = pl.BlockSpec((E,), lambda e, i, j: (0,))
  sums_EKN = pl.pallas_call(
    kernel,
    grid=(E, K // bk, N // bn),
    in_specs=[
      whole_groups,
      whole_groups,
      pl.BlockSpec((n_rows, bk), lambda e, i, j: (0, i)),
      pl.BlockSpec((n_rows, bn), lambda e, i, j: (0, j)),
    ],
    out_specs=pl.BlockSpec((pl.squeezed, bk, bn), lambda e, i, j: (e, i, j)),
    out_shape=jax.ShapeDtypeStruct((E, K, N), dtype),
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="grouped_matmul_t",
  )(starts_E, ends_E, lhs_SK, dout_SN)
  return sums_EKN[:, :k_out, :n_out]
