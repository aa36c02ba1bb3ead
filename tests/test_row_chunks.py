"""Table-gradient sums with hot rows cut into chunks (kernels/rows/row_chunks.py) equal a float64 NumPy segment sum.

The reference sums each row's pairs from the definition, sums[r] = sum over pairs p with rows[p] == r of
coefs[p] * values[tokens[p]], with nothing of the chunking; rows are drawn skewed (a few rows take most pairs)
so heads, tails, empty rows and unused tail segments all occur."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import row_chunks, segment_grads, triton


def skewed_pairs(n_pairs, n_rows, n_tokens, seed):
  rng = np.random.default_rng(seed)
  weights = 1.0 / np.arange(1, n_rows + 1) ** 1.5  # Zipf-like: row 0 takes about 40% of the pairs
  rows = rng.permutation(n_rows)[rng.choice(n_rows, n_pairs, p=weights / weights.sum())]
  tokens = rng.integers(0, n_tokens, n_pairs)
  coefs = rng.standard_normal(n_pairs).astype(np.float32)
  return rows.astype(np.int32), tokens.astype(np.int32), coefs


def reference(values, rows, tokens, coefs, n_rows):
  sums = np.zeros((n_rows, values.shape[1]))
  coef_sums = np.zeros(n_rows)
  np.add.at(sums, rows, coefs[:, None].astype(np.float64) * values[tokens].astype(np.float64))
  np.add.at(coef_sums, rows, coefs.astype(np.float64))
  return sums, coef_sums


@pytest.mark.parametrize("chunk", [1, 3, 16, 0])
def test_chunked_segment_sums_equal_float64_reference(chunk):
  n_pairs, n_rows, n_tokens, d_model = 300, 24, 40, 32
  rows, tokens, coefs = skewed_pairs(n_pairs, n_rows, n_tokens, seed=chunk)
  values = np.random.default_rng(7).standard_normal((n_tokens, d_model)).astype(np.float32)
  options = KernelOptions(segment_chunk=chunk, interpret=True, block_d=32)

  @jax.jit
  def run(values, rows, tokens, coefs):
    order_P, sorted_rows_P = segment_grads.sort_pairs(rows, n_rows)
    starts_R1 = segment_grads.row_starts(sorted_rows_P, n_rows)
    return row_chunks.segment_sums(
      triton, values, tokens[order_P], coefs[order_P], sorted_rows_P, starts_R1, options, with_coef_sums=True
    )

  sums, coef_sums = run(values, rows, tokens, coefs)
  want_sums, want_coef_sums = reference(values, rows, tokens, coefs, n_rows)
  # float32 sums of at most 300 terms of size ~1: each rounding is at most 2**-24 of a partial sum below 300 * 4
  np.testing.assert_allclose(np.asarray(sums), want_sums, rtol=0, atol=300 * 4 * 300 * 2**-24)
  np.testing.assert_allclose(np.asarray(coef_sums), want_coef_sums, rtol=0, atol=300 * 4 * 300 * 2**-24)
  assert np.bincount(rows, minlength=n_rows).max() > 3 * max(chunk, 1)  # the hottest row is cut


def test_plan_bounds_every_segment_and_keeps_short_rows_in_place():
  n_pairs, n_rows, chunk = 300, 24, 8
  rows, _, _ = skewed_pairs(n_pairs, n_rows, 40, seed=3)
  sorted_rows = jnp.sort(rows)
  starts = segment_grads.row_starts(sorted_rows, n_rows)
  plan = jax.jit(row_chunks.plan, static_argnums=2)(sorted_rows, starts, chunk)
  starts_V1 = np.asarray(plan.starts_V1)
  lengths = np.diff(starts_V1)
  assert lengths.min() >= 0 and lengths.max() <= chunk and starts_V1[-1] == n_pairs
  assert len(lengths) == n_rows + row_chunks.tail_segments(n_pairs, chunk)
  counts = np.bincount(rows, minlength=n_rows)
  np.testing.assert_array_equal(lengths[:n_rows], np.minimum(counts, chunk))  # every row's head, in row order
  assert sorted(np.asarray(plan.order_P)) == list(range(n_pairs))  # a permutation of the sorted pairs
  # every pair of a segment belongs to the row that segment is summed into
  owner = np.concatenate([np.arange(n_rows), np.zeros(len(lengths) - n_rows, int)])
  tails = np.repeat(np.arange(n_rows), -(-np.maximum(counts - chunk, 0) // chunk))
  owner[n_rows : n_rows + len(tails)] = tails
  np.testing.assert_array_equal(np.asarray(sorted_rows)[np.asarray(plan.order_P)], np.repeat(owner, lengths))
