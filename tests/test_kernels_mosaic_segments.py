"""mosaic.segment_sums (the table gradient) equals a float64 NumPy segment sum in interpret mode without
shared-memory races, and lowers for CUDA at a ladder-like shape (Mosaic GPU's layout and TMA checks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import mosaic_races_found

from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import mosaic
from sparsetx.measure import aot

EPS32 = 2.0**-24  # float32 rounding unit


def segment_case(seed, n_tokens, d_model, counts_R, n_padding, dtype):
  """values [N, D] in dtype, pairs sorted by row with counts_R pairs per row, then n_padding pairs past starts[R]
  whose tokens are out of range and whose coefficients are NaN (the kernel must never read them)."""
  rng = np.random.default_rng(seed)
  starts_R1 = np.concatenate([[0], np.cumsum(counts_R)]).astype(np.int32)
  n_valid = int(starts_R1[-1])
  tokens_P = np.concatenate([rng.integers(0, n_tokens, n_valid), np.full(n_padding, 10**6)]).astype(np.int32)
  coefs_P = np.concatenate([rng.normal(size=n_valid), np.full(n_padding, np.nan)]).astype(np.float32)
  values_ND = jnp.asarray(rng.normal(size=(n_tokens, d_model)), dtype)
  return values_ND, tokens_P, coefs_P, starts_R1


def reference(values_ND, tokens_P, coefs_P, starts_R1):
  """(sums [R, D], coef_sums [R], their bounds) in float64; bound = n * eps32 * sum_p |term_p| with n the longest
  row's pair count: the float32 error bound of a length-n dot product (products and sums rounded)."""
  values = np.asarray(jnp.asarray(values_ND, jnp.float32), np.float64)  # bf16 -> float32 is exact
  n_rows = len(starts_R1) - 1
  sums, abs_sums = np.zeros((n_rows, values.shape[1])), np.zeros((n_rows, values.shape[1]))
  coef_sums, abs_coef_sums = np.zeros(n_rows), np.zeros(n_rows)
  for r in range(n_rows):
    pairs = slice(starts_R1[r], starts_R1[r + 1])
    coefs, rows = coefs_P[pairs].astype(np.float64), values[tokens_P[pairs]]
    sums[r], abs_sums[r] = coefs @ rows, np.abs(coefs) @ np.abs(rows)
    coef_sums[r], abs_coef_sums[r] = coefs.sum(), np.abs(coefs).sum()
  longest = max(1, int(np.diff(starts_R1).max()))
  return sums, coef_sums, longest * EPS32 * abs_sums, longest * EPS32 * abs_coef_sums


def counts(n_rows, seed, most, long_rows):
  """Pairs per row: 0 to `most` (many empty rows), and {row: count} for rows spanning 64-pair tiles."""
  counts_R = np.random.default_rng(seed).integers(0, most + 1, n_rows)
  counts_R[0] = 0
  for row, count in long_rows.items():
    counts_R[row] = count
  return counts_R


@pytest.mark.parametrize(
  "dtype, n_tokens, d_model, counts_R, n_padding, block_d, stages, with_coef_sums, wraps_ring",
  [
    # R = 70: two row blocks, the second ragged; the first block's pairs fill 3 tiles through a 2-tile ring, its
    # 110-pair row spans them
    (jnp.float32, 13, 64, counts(70, 1, 1, {5: 110, 66: 2}), 7, 64, 2, True, True),
    # bf16 values: two 64-value chunks (128 bytes), R = 9, more stages than tiles
    (jnp.bfloat16, 9, 128, counts(9, 2, 3, {}), 3, 64, 3, False, False),
  ],
)
def test_segment_sums_equal_float64_reference(
  dtype, n_tokens, d_model, counts_R, n_padding, block_d, stages, with_coef_sums, wraps_ring
):
  values, tokens, coefs, starts = segment_case(3, n_tokens, d_model, counts_R, n_padding, dtype)
  assert len(tokens) % 64 and (len(starts) - 1) % 64  # ragged P and R
  assert (-(-counts_R[:64].sum() // 64) > stages) == wraps_ring  # the first block's tiles reuse ring slots
  options = KernelOptions(block_d=block_d, stages=stages, interpret=True)
  run = jax.jit(lambda *a: mosaic.segment_sums(*a, options, with_coef_sums=with_coef_sums))
  sums, coef_sums = run(values, tokens, coefs, starts)
  assert not mosaic_races_found()
  expected, expected_coef_sums, bound, coef_bound = reference(values, tokens, coefs, starts)
  assert sums.dtype == jnp.float32 and sums.shape == expected.shape
  assert np.all(np.abs(np.asarray(sums, np.float64) - expected) <= bound)
  assert np.all(np.asarray(sums)[counts_R == 0] == 0)  # empty rows are exactly zero
  if with_coef_sums:
    assert coef_sums.dtype == jnp.float32 and coef_sums.shape == expected_coef_sums.shape
    assert np.all(np.abs(np.asarray(coef_sums, np.float64) - expected_coef_sums) <= coef_bound)
  else:
    assert coef_sums is None


@pytest.mark.parametrize("with_coef_sums", [False, True])
def test_segment_sums_lower_for_cuda_at_a_ladder_shape(with_coef_sums):
  """4096 tokens x 128 slots of pairs into 16 * 5776 rows, d_model 640 in bf16: five 128-value chunks."""
  spec = jax.ShapeDtypeStruct
  n_tokens, n_pairs, n_rows, d_model = 4096, 4096 * 128, 16 * 5776, 640
  args = (
    spec((n_tokens, d_model), jnp.bfloat16),
    spec((n_pairs,), jnp.int32),
    spec((n_pairs,), jnp.float32),
    spec((n_rows + 1,), jnp.int32),
  )
  f = lambda *a: mosaic.segment_sums(*a, KernelOptions(), with_coef_sums=with_coef_sums)
  with aot.on_topology("h100:1x1x1"):
    text = jax.jit(f).trace(*args).lower().as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_segment_sums_shapes_and_checks():
  """No pairs: zero rows without a kernel; on a GPU a d_model chunk spans the compute warpgroup's 128 threads."""
  values, tokens, coefs = jnp.zeros((4, 64)), jnp.zeros((5,), jnp.int32), jnp.ones((5,))
  sums, coef_sums = mosaic.segment_sums(
    values, tokens[:0], coefs[:0], jnp.zeros((3,), jnp.int32), KernelOptions(), True
  )
  assert sums.shape == (2, 64) and not np.any(sums) and coef_sums.shape == (2,) and not np.any(coef_sums)
  starts = jnp.array([0, 5], jnp.int32)
  with (
    aot.on_topology("h100:1x1x1"),
    pytest.raises(ValueError, match="d_model=64 has no chunk .* multiple of 128 values"),
  ):
    jax.jit(lambda *a: mosaic.segment_sums(*a, KernelOptions())).trace(values, tokens, coefs, starts)
