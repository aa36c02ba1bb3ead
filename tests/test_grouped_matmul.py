"""MoE's grouped matmul (kernels/grouped_matmul/op.py) against its definition: out[s] = lhs[s] @ rhs[g(s)] over rows
sorted by group, dlhs[s] = dout[s] @ rhs[g(s)].T and drhs[e] = sum_{s in e} outer(lhs[s], dout[s]), computed in
float64 with numpy. Each backend that runs on a CPU is checked: the XLA tile loop (the CPU's path), the Triton
kernels in interpret mode (A100s, and 32-bit operands on any GPU) and the TPU's (ragged_dot, and megablox's tgmm
in interpret mode). The Hopper forward is the pinned JAX's Mosaic GPU ragged dot, which has no interpret mode:
test_compile.py compiles it.

Bounds follow from the arithmetic: every operand is a value of the operands' dtype, so the products are exact
in float64 and the only errors are the float32 sums (at most n * 2^-24 * sum |terms| over n terms) and one
rounding of the result to the operands' dtype (half an ulp: 2^-8 relative for bf16, 2^-24 for float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsetx.kernels.grouped_matmul import op as gm
from sparsetx.kernels.grouped_matmul import tpu, triton, xla
from sparsetx.kernels.grouped_matmul.tiles import n_tiles, row_tiles
from sparsetx.kernels.options import KernelOptions

F32_U = 2.0**-24
HALF_ULP = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float32): 2.0**-24}

BACKENDS = {
  "xla": ((xla.gmm, xla.tgmm), KernelOptions(implementation="xla", group_rows=32)),
  "triton": ((triton.gmm, triton.tgmm), KernelOptions(group_rows=32, interpret=True)),
  "tpu": ((tpu.gmm, tpu.tgmm), KernelOptions(interpret=True)),  # ragged_dot, megablox tgmm
}

# (group sizes, rows): empty groups, one group taking every row, sizes off the 32-row tile, padding rows at the end
SIZES = {
  "empty_groups": ([0, 70, 0, 33, 97, 0], 200),
  "one_takes_all": ([0, 0, 200, 0], 200),
  "off_tile_with_padding": ([1, 31, 32, 33, 5, 0, 64], 190),
  "all_padding": ([0, 0, 0], 40),
}


def as64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def group_of_rows(sizes, n_rows):
  """The group of each row, -1 for rows after the last group."""
  groups = np.repeat(np.arange(len(sizes)), sizes)
  return np.concatenate([groups, -np.ones(n_rows - len(groups), int)])


def case(sizes, n_rows, K, N, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(k[0], (n_rows, K), jnp.float32).astype(dtype)
  rhs = jax.random.normal(k[1], (len(sizes), K, N), jnp.float32)  # float32 parameters, read in lhs's dtype
  dout = jax.random.normal(k[2], (n_rows, N), jnp.float32).astype(dtype)
  return lhs, rhs, dout, jnp.asarray(sizes, jnp.int32)


def reference(lhs, rhs, dout, sizes, n_rows):
  """float64 (out, dlhs, drhs, and the sums of |terms| each bound scales with)."""
  groups = group_of_rows(np.asarray(sizes), n_rows)
  x, r, d = as64(lhs), as64(jnp.asarray(rhs).astype(lhs.dtype)), as64(dout)
  r_of_row = np.where(groups[:, None, None] >= 0, r[np.maximum(groups, 0)], 0.0)  # [S, K, N]
  out = np.einsum("sk,skn->sn", x, r_of_row)
  out_abs = np.einsum("sk,skn->sn", np.abs(x), np.abs(r_of_row))
  dlhs = np.einsum("sn,skn->sk", d, r_of_row)
  dlhs_abs = np.einsum("sn,skn->sk", np.abs(d), np.abs(r_of_row))
  member = (groups[None, :] == np.arange(len(sizes))[:, None]).astype(np.float64)  # [E, S]
  drhs = np.einsum("es,sk,sn->ekn", member, x, d)
  drhs_abs = np.einsum("es,sk,sn->ekn", member, np.abs(x), np.abs(d))
  return (out, out_abs), (dlhs, dlhs_abs), (drhs, drhs_abs)


def assert_within(result, expected, abs_terms, n_terms, half_ulp, name):
  bound = n_terms * F32_U * abs_terms + half_ulp * (np.abs(expected) + n_terms * F32_U * abs_terms)
  error = np.abs(as64(result) - expected)
  assert np.all(error <= bound), (
    f"{name}: worst error {error.max()} where the bound is {bound.flat[np.argmax(error - bound)]}"
  )


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("sizes_name", list(SIZES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_matmul_and_gradients_equal_float64(backend, sizes_name, dtype):
  """K = 48 and N = 40 (the Triton kernels pad 40 to 48 and walk both in 16-wide chunks)."""
  kernels, options = BACKENDS[backend]
  sizes, n_rows = SIZES[sizes_name]
  K, N = 48, 40
  lhs, rhs, dout, sizes_E = case(sizes, n_rows, K, N, dtype)
  out, vjp = jax.vjp(lambda x, w: gm._grouped(kernels, options, x, w, sizes_E), lhs, rhs)
  dlhs, drhs = vjp(dout)
  (ref_out, out_abs), (ref_dlhs, dlhs_abs), (ref_drhs, drhs_abs) = reference(lhs, rhs, dout, sizes, n_rows)
  half_ulp = HALF_ULP[jnp.dtype(dtype)]
  assert out.dtype == dlhs.dtype == dtype and drhs.dtype == rhs.dtype
  assert_within(out, ref_out, out_abs, K, half_ulp, "out")
  assert_within(dlhs, ref_dlhs, dlhs_abs, N, half_ulp, "dlhs")
  assert_within(drhs, ref_drhs, drhs_abs, max(max(sizes), 1), half_ulp, "drhs")
  routed = sum(sizes)
  assert not np.any(as64(out)[routed:]) and not np.any(as64(dlhs)[routed:])  # padding rows: exact zeros
  assert not np.any(as64(drhs)[np.asarray(sizes) == 0])  # an empty group's gradient: exact zeros


def test_grouped_matmul_is_ragged_dot_where_the_compiler_groups_it():
  """On a CPU with implementation=xla the op is the tile loop; ragged_dot (the TPU's op) gives the same values
  within the same bounds (both are float32 sums of the same products)."""
  sizes, n_rows = SIZES["off_tile_with_padding"]
  lhs, rhs, _, sizes_E = case(sizes, n_rows, 64, 32, jnp.float32, seed=1)
  ours = gm.grouped_matmul(lhs, rhs, sizes_E, KernelOptions(implementation="xla", group_rows=32))
  (ref_out, out_abs), _, _ = reference(lhs, rhs, lhs[:, :32], sizes, n_rows)
  assert_within(ours, ref_out, out_abs, 64, 2.0**-24, "tile loop")
  assert_within(gm.ragged_dot(lhs, rhs, sizes_E), ref_out, out_abs, 64, 2.0**-24, "ragged_dot")


@pytest.mark.parametrize("sizes_name", list(SIZES))
def test_row_tiles_cover_each_row_once_within_the_static_bound(sizes_name):
  """Every routed row lies in exactly one tile, each tile inside one group and one row block; the tiles used never
  exceed cdiv(rows, tile) + groups - 1."""
  sizes, n_rows = SIZES[sizes_name]
  tile = 32
  group_T, block_T, lo_T, hi_T = (np.asarray(a) for a in row_tiles(jnp.asarray(sizes), n_rows, tile))
  assert len(group_T) == n_tiles(n_rows, len(sizes), tile)
  groups = group_of_rows(np.asarray(sizes), n_rows)
  covered = np.zeros(n_rows, int)
  for g, b, lo, hi in zip(group_T, block_T, lo_T, hi_T):
    if lo == hi:
      continue
    assert b * tile <= lo < hi <= (b + 1) * tile and np.all(groups[lo:hi] == g)
    covered[lo:hi] += 1
  assert np.array_equal(covered, (groups >= 0).astype(int))
