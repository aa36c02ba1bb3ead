"""The grouped matmul in XLA for a CPU: a loop over row tiles (group_tiles.py), each one group's rows times that
group's matrix, so the work follows the routed rows. This is CPU-only tuning (a tile of `kernel.group_rows`
rows stays in cache); a GPU or TPU never runs these loops (grouped_matmul.py picks its kernels)."""

import jax
import jax.numpy as jnp

from sparsetx.kernels.grouped_matmul.tiles import row_tiles


def _tiled_rows(a_SX, tile):
  n_rows = a_SX.shape[0]
  return jnp.pad(a_SX, ((0, -n_rows % tile), (0, 0)))


def _live(lo, hi, block, tile):
  row_t = block * tile + jnp.arange(tile, dtype=jnp.int32)
  return ((row_t >= lo) & (row_t < hi))[:, None]


def gmm(lhs_SK, rhs_EKN, group_sizes_E, transpose_rhs, options):
  """[S, N] in lhs's dtype: lhs[s] @ rhs[group(s)] (rhs[group(s)].T with transpose_rhs), float32 sums; rows after
  the last group are zeros."""
  n_rows = lhs_SK.shape[0]
  tile = options.group_rows
  lhs_pK = _tiled_rows(lhs_SK, tile)
  n_out = rhs_EKN.shape[1 if transpose_rhs else 2]
  dims = (((1,), (1 if transpose_rhs else 0,)), ((), ()))

  def step(out_pN, t):
    group, block, lo, hi = t
    rows_tK = jax.lax.dynamic_slice_in_dim(lhs_pK, block * tile, tile)
    y_tN = jax.lax.dot_general(rows_tK, rhs_EKN[group].astype(lhs_SK.dtype), dims, preferred_element_type=jnp.float32)
    here_tN = jax.lax.dynamic_slice_in_dim(out_pN, block * tile, tile)
    here_tN = jnp.where(_live(lo, hi, block, tile), y_tN.astype(out_pN.dtype), here_tN)
    return jax.lax.dynamic_update_slice_in_dim(out_pN, here_tN, block * tile, 0), None

  out_pN = jnp.zeros((lhs_pK.shape[0], n_out), lhs_SK.dtype)
  out_pN, _ = jax.lax.scan(step, out_pN, row_tiles(group_sizes_E, n_rows, tile))
  return out_pN[:n_rows]


def tgmm(lhs_SK, dout_SN, group_sizes_E, options):
  """[E, K, N] in lhs's dtype: sum over group e's rows s of outer(lhs[s], dout[s]), float32 sums (empty group:
  zeros; rows after the last group are left out)."""
  n_rows, K = lhs_SK.shape
  E, N = group_sizes_E.shape[0], dout_SN.shape[1]
  tile = options.group_rows
  lhs_pK, dout_pN = _tiled_rows(lhs_SK, tile), _tiled_rows(dout_SN, tile)

  def step(sums_EKN, t):
    group, block, lo, hi = t
    live = _live(lo, hi, block, tile)
    rows_tK = jnp.where(live, jax.lax.dynamic_slice_in_dim(lhs_pK, block * tile, tile), 0)
    dout_tN = jnp.where(live, jax.lax.dynamic_slice_in_dim(dout_pN, block * tile, tile), 0)
    outer_KN = jax.lax.dot_general(rows_tK, dout_tN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return sums_EKN.at[group].add(outer_KN), None

  sums_EKN, _ = jax.lax.scan(step, jnp.zeros((E, K, N), jnp.float32), row_tiles(group_sizes_E, n_rows, tile))
  return sums_EKN.astype(lhs_SK.dtype)
