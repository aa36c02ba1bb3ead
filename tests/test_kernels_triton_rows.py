"""The Triton row kernels (triton.row_dots, row_accumulate, segment_sums; issue 24) in interpret mode
equal float64 NumPy references within the float32 summation bound, and lower for CUDA at ladder shapes.

Bound: a sum of n float32-rounded products, added in float32 in any order, is within gamma(n) * sum|terms| of
the exact sum (Higham, Accuracy and Stability, eq. 3.5: gamma(n) = n u / (1 - n u), u = 2**-24); the float64
reference adds its own gamma_64(n). A result stored in bf16 is rounded once more: u_bf16 * |value| on top.
"""

from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.pallas.triton import lowering as triton_lowering  # the Triton module of each kernel (no public API)

from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import triton
from sparsetx.kernels.rows.reference import Gating
from sparsetx.measure import aot
from sparsetx.perf import hlo_text

U32, U64 = 2.0**-24, 2.0**-53
UNIT = {np.dtype(np.float32): U32, np.dtype(ml_dtypes.bfloat16): 2.0**-8}


def sum_bound(n, abs_sum):
  """Largest |float32 sum - float64 reference| for sums of n products with sum |products| = abs_sum."""
  gamma = lambda u: n * u / (1 - n * u)
  return (gamma(U32) + gamma(U64)) * abs_sum


def rounded(a, dtype):
  """a rounded to dtype, as float64 (the value the kernel computes with)."""
  return np.asarray(a, np.float32).astype(dtype).astype(np.float64)


def assert_within(got, exact, bound, name):
  excess = np.abs(np.asarray(got, np.float64) - exact) - bound
  assert np.all(excess <= 0), (
    f"{name}: exceeds its bound by up to {excess.max()} at {np.unravel_index(excess.argmax(), excess.shape)}"
  )


def options(block_tokens):
  return KernelOptions("triton", block_tokens=block_tokens, interpret=True)


# (tokens N, slots S, table rows R, d_model D, lhs / out dtype, table dtype, block_tokens): ragged N, S not a
# power of two, D a non-power-of-two multiple of 128 (three chunks) and a small power of two.
ROW_CASES = [
  (13, 5, 37, 384, np.float32, np.float32, 4),
  (11, 3, 29, 64, ml_dtypes.bfloat16, np.float32, 8),  # float32 table rows rounded to bf16
]


@pytest.mark.parametrize("n, s, r, d, dtype, table_dtype, block_tokens", ROW_CASES)
def test_row_dots_match_the_float64_sum(n, s, r, d, dtype, table_dtype, block_tokens):
  rng = np.random.default_rng(n * d)
  lhs_ND = rng.normal(size=(n, d)).astype(dtype)
  table_RD = rng.normal(size=(r, d)).astype(table_dtype)
  rows_SN = rng.integers(0, r, (s, n)).astype(np.int32)
  dots_SN = triton.row_dots(jnp.asarray(lhs_ND), jnp.asarray(table_RD), jnp.asarray(rows_SN), options(block_tokens))
  assert dots_SN.shape == (s, n) and dots_SN.dtype == jnp.float32
  terms_SND = lhs_ND.astype(np.float64)[None] * rounded(table_RD, dtype)[rows_SN]  # table rounded to lhs's dtype
  assert_within(dots_SN, terms_SND.sum(-1), sum_bound(d, np.abs(terms_SND).sum(-1)), "dots")


@pytest.mark.parametrize("n, s, r, d, out_dtype, table_dtype, block_tokens", ROW_CASES)
def test_row_accumulate_matches_the_float64_sum(n, s, r, d, out_dtype, table_dtype, block_tokens):
  rng = np.random.default_rng(n * d + 1)
  coef_SN = rng.normal(size=(s, n)).astype(np.float32)
  table_RD = rng.normal(size=(r, d)).astype(table_dtype)
  rows_SN = rng.integers(0, r, (s, n)).astype(np.int32)
  out_ND = triton.row_accumulate(
    jnp.asarray(coef_SN), jnp.asarray(table_RD), jnp.asarray(rows_SN), out_dtype, options(block_tokens)
  )
  assert out_ND.shape == (n, d) and out_ND.dtype == out_dtype
  terms_SND = coef_SN.astype(np.float64)[..., None] * rounded(table_RD, out_dtype)[rows_SN]
  exact_ND, bound_ND = terms_SND.sum(0), sum_bound(s, np.abs(terms_SND).sum(0))
  if out_dtype != np.float32:  # the float32 sum, rounded once to out_dtype
    bound_ND = bound_ND + UNIT[np.dtype(out_dtype)] * (np.abs(exact_ND) + bound_ND)
  assert_within(out_ND, exact_ND, bound_ND, "out")


def sorted_pairs(rng, lengths, n_tokens, n_padding):
  """starts [R + 1] for row lengths, token ids and coefficients of the pairs, n_padding pairs past starts[R]."""
  starts_R1 = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  n_pairs = int(starts_R1[-1]) + n_padding
  tokens_P = rng.integers(0, n_tokens, n_pairs).astype(np.int32)
  coefs_P = rng.normal(size=n_pairs).astype(np.float32)
  coefs_P[starts_R1[-1] :] = 1e6  # padding pairs: any sign of them would be plain
  return starts_R1, tokens_P, coefs_P


@pytest.mark.parametrize(
  "n_rows, n, d, dtype, with_coef_sums, n_padding",
  [
    (21, 13, 384, np.float32, True, 3),  # two 16-row tiles, three d chunks
    (37, 7, 64, ml_dtypes.bfloat16, False, 0),
  ],
)
def test_segment_sums_match_the_float64_sums(n_rows, n, d, dtype, with_coef_sums, n_padding):
  rng = np.random.default_rng(n_rows * d)
  lengths = rng.integers(0, 4, n_rows)
  lengths[[0, 6, n_rows - 1]] = 0  # empty rows, first and last among them
  lengths[5] = 11  # one long row: its tile walks 11 steps while its other rows end early
  starts_R1, tokens_P, coefs_P = sorted_pairs(rng, lengths, n, n_padding)
  values_ND = rng.normal(size=(n, d)).astype(dtype)
  sums_RD, coef_sums_R = triton.segment_sums(
    jnp.asarray(values_ND),
    jnp.asarray(tokens_P),
    jnp.asarray(coefs_P),
    jnp.asarray(starts_R1),
    options(8),
    with_coef_sums=with_coef_sums,
  )
  assert sums_RD.shape == (n_rows, d) and sums_RD.dtype == jnp.float32
  exact_RD, abs_RD = np.zeros((n_rows, d)), np.zeros((n_rows, d))
  exact_R, abs_R = np.zeros(n_rows), np.zeros(n_rows)
  for row in range(n_rows):
    for p in range(starts_R1[row], starts_R1[row + 1]):
      term_D = float(coefs_P[p]) * values_ND[tokens_P[p]].astype(np.float64)
      exact_RD[row] += term_D
      abs_RD[row] += np.abs(term_D)
      exact_R[row] += coefs_P[p]
      abs_R[row] += abs(float(coefs_P[p]))
  longest = lengths.max()
  assert_within(sums_RD, exact_RD, sum_bound(longest, abs_RD), "sums")
  assert np.all(np.asarray(sums_RD)[lengths == 0] == 0)  # rows with no pairs are exactly zero
  if with_coef_sums:
    assert coef_sums_R.shape == (n_rows,) and coef_sums_R.dtype == jnp.float32
    assert_within(coef_sums_R, exact_R, sum_bound(longest, abs_R), "coef_sums")
    assert np.all(np.asarray(coef_sums_R)[lengths == 0] == 0)
  else:
    assert coef_sums_R is None


def test_segment_sums_without_pairs_are_zero():
  starts_R1 = jnp.zeros((4,), jnp.int32)
  empty_i, empty_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
  sums_RD, coef_sums_R = triton.segment_sums(
    jnp.ones((5, 16), jnp.bfloat16), empty_i, empty_f, starts_R1, options(8), with_coef_sums=True
  )
  np.testing.assert_array_equal(sums_RD, np.zeros((3, 16)))
  np.testing.assert_array_equal(coef_sums_R, np.zeros(3))


@pytest.mark.parametrize("d", [640, 384])  # ladder widths, neither a power of two
def test_row_kernels_lower_for_cuda_at_ladder_shapes(d):
  """Each kernel becomes one Triton call whose module passes MLIR verification; the kernels that walk pairs by row
  (segment_sums, row_order_dots) and the fused forward use no atomics."""
  n, s, r = 4096, 128, 16 * 5776
  spec = jax.ShapeDtypeStruct
  modules = {}
  lower_module = triton_lowering.lower_jaxpr_to_triton_module

  def verified(*args, **kwargs):
    result = lower_module(*args, **kwargs)
    assert result.module.operation.verify()
    text = result.module.operation.get_asm()
    names = ("row_order_dots", "row_dots", "row_accumulate", "segment_sums", "fused_forward")
    modules[next(name for name in names if name in text)] = text
    return result

  def kernels(lhs_ND, table_RD, rows_SN, coef_SN, tokens_P, coefs_P, starts_R1):
    o = KernelOptions("triton")
    return (
      triton.row_dots(lhs_ND, table_RD, rows_SN, o),
      triton.row_accumulate(coef_SN, table_RD, rows_SN, jnp.bfloat16, o),
      triton.segment_sums(lhs_ND, tokens_P, coefs_P, starts_R1, o, with_coef_sums=True),
      triton.row_order_dots(lhs_ND, table_RD, tokens_P, tokens_P, starts_R1, o),
      triton.fused_forward(lhs_ND, table_RD, table_RD, rows_SN.T, coef_SN.T, None, Gating(), o),
    )

  args = [
    spec((n, d), jnp.bfloat16),
    spec((r, d), jnp.bfloat16),
    spec((s, n), jnp.int32),
    spec((s, n), jnp.float32),
    spec((n * s,), jnp.int32),
    spec((n * s,), jnp.float32),
    spec((r + 1,), jnp.int32),
  ]
  with aot.on_topology("a100:1x1x1"), mock.patch.object(triton_lowering, "lower_jaxpr_to_triton_module", verified):
    text = jax.jit(kernels).trace(*args).lower().as_text()
  calls = {name: count for (call, name), count in hlo_text.custom_calls(text).items() if call == "__gpu$xla.gpu.triton"}
  assert calls == {
    name: 1 for name in ("row_dots", "row_accumulate", "segment_sums", "row_order_dots", "fused_forward")
  }
  assert sorted(modules) == sorted(calls)
  assert not any("atomic" in modules[name] for name in ("segment_sums", "row_order_dots", "fused_forward"))
