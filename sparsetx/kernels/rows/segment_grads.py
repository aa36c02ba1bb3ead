"""Table gradients of the gated gather by sorting (token, slot) pairs by row and summing segments.

dW_in[r] = sum over pairs (t, s) with rows[t, s] == r of coef_in[t, s] * x[t], and likewise for W_out with
dy. Pairs are sorted by row once (shared by both tables and the bias), then summed per row in float32:
deterministic, each row written once, nothing accumulated in bf16 (the shape of FBGEMM's table-batched
embedding backward).

More: docs/modules.md, sparsetx/kernels/rows/segment_grads.py.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsetx import scopes
from sparsetx.kernels import platform
from sparsetx.kernels.rows import row_chunks

_INT32_LIMIT = 2**31 - 1


def packs_in_int32(n_rows: int, n_minor: int) -> bool:
  """Whether a (row, minor) pair fits one int32 sort key, row * n_minor + minor."""
  return n_rows * n_minor <= _INT32_LIMIT


def packed_keys(rows, minor, n_minor: int):
  """One int32 sort key per (row, minor) pair, row * n_minor + minor, where packs_in_int32 holds: one single-key
  sort of them is much faster than a (key, value) sort on a CPU."""
  return rows.astype(jnp.int32) * n_minor + minor


def sort_pairs(rows_P, n_rows):
  """Pair ids ordered by row (ties in any fixed order) and the rows in that order."""
  n_pairs = rows_P.shape[0]
  rows_P = rows_P.astype(jnp.int32)
  pair_P = jax.lax.iota(jnp.int32, n_pairs)
  if packs_in_int32(n_rows, n_pairs):
    packed_P = jax.lax.sort(packed_keys(rows_P, pair_P, n_pairs), is_stable=False)
    return packed_P % n_pairs, packed_P // n_pairs
  sorted_rows_P, order_P = jax.lax.sort((rows_P, pair_P), num_keys=1, is_stable=False)
  return order_P, sorted_rows_P


def row_starts(sorted_rows_P, n_rows):
  """[R + 1] int32: row r's pairs are [starts[r], starts[r + 1]) of the sorted order.

  An unrolled binary search (log2 P gathers of R + 1 values): no device loop, unlike the default scan method."""
  boundaries = jnp.arange(n_rows + 1, dtype=jnp.int32)
  return jnp.searchsorted(sorted_rows_P, boundaries, side="left", method="scan_unrolled").astype(jnp.int32)


class SortedPairs(NamedTuple):
  """The (token, slot) pairs in row order: their rows, tokens and both tables' coefficients, each [P]."""

  rows_P: jax.Array
  tokens_P: jax.Array
  coef_in_P: jax.Array
  coef_out_P: jax.Array


def _sorted(rows_NS, coef_in_NS, coef_out_NS, n_rows) -> SortedPairs:
  n_slots = rows_NS.shape[1]
  order_P, sorted_rows_P = sort_pairs(rows_NS.reshape(-1), n_rows)
  return SortedPairs(
    sorted_rows_P, order_P // n_slots, coef_in_NS.reshape(-1)[order_P], coef_out_NS.reshape(-1)[order_P]
  )


@jax.named_scope(scopes.TABLE_GRADS)
def table_grads(implementation, x_ND, dy_ND, rows_NS, coef_in_NS, coef_out_NS, n_rows, options, with_bias):
  """(dW_in [R, D], dW_out [R, D], dbias [R] or None), all float32: the pairs sorted once, summed by the
  implementation's table_sums (backend.RowKernels)."""
  with jax.named_scope(scopes.SORT):
    pairs = _sorted(rows_NS, coef_in_NS, coef_out_NS, n_rows)
  return implementation.table_sums(x_ND, dy_ND, pairs, n_rows, options, with_bias)


def kernel_table_sums(implementation, x_ND, dy_ND, pairs, n_rows, options, with_bias):
  """Both tables' sums by the implementation's segment_sums kernel, hot rows cut into chunks (row_chunks.py)."""
  with jax.named_scope(scopes.SORT):
    starts_R1 = row_starts(pairs.rows_P, n_rows)
    chunks = None
    if row_chunks.tail_segments(pairs.rows_P.shape[0], options.segment_chunk):
      chunks = row_chunks.plan(pairs.rows_P, starts_R1, options.segment_chunk)  # one plan for both tables
  sums = lambda values, coefs, with_coef_sums: row_chunks.segment_sums(  # noqa: E731
    implementation, values, pairs.tokens_P, coefs, pairs.rows_P, starts_R1, options, with_coef_sums, chunks
  )
  with jax.named_scope(scopes.SEGMENT_SUMS):
    dw_in, dbias = sums(x_ND, pairs.coef_in_P, with_bias)
    dw_out, _ = sums(dy_ND, pairs.coef_out_P, False)
  return dw_in, dw_out, dbias


def scatter_segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
  """XLA's segment_sums (backend.RowKernels): sorted scatter-adds of float32 products into each pair's row."""
  del options
  n_rows, n_pairs = starts_R1.shape[0] - 1, tokens_P.shape[0]
  rows_P = jnp.searchsorted(starts_R1[1:], jnp.arange(n_pairs, dtype=jnp.int32), side="right").astype(jnp.int32)
  terms_PD = coefs_P.astype(jnp.float32)[:, None] * values_ND.astype(jnp.float32)[tokens_P]
  sums_RD = jax.ops.segment_sum(terms_PD, rows_P, n_rows, indices_are_sorted=True)
  coef_sums_R = jax.ops.segment_sum(coefs_P.astype(jnp.float32), rows_P, n_rows, indices_are_sorted=True)
  return sums_RD, coef_sums_R if with_coef_sums else None


@jax.named_scope(scopes.SEGMENT_SUMS)
def scan_table_sums(x_ND, dy_ND, pairs, n_rows, options, with_bias):
  """XLA's table_sums: sorted scatter-adds of both tables in one scan, `platform.cpu_chunk(options.pair_chunk)`
  pairs per step."""
  sorted_rows_P, token_P, coef_in_P, coef_out_P = pairs
  n_pairs = sorted_rows_P.shape[0]
  pair_chunk = platform.cpu_chunk(options.pair_chunk, n_pairs)
  n_padded = -(-n_pairs // pair_chunk) * pair_chunk
  pad = n_padded - n_pairs
  # Padding pairs point one past the last row (dropped) with zero coefficients; order stays sorted.
  chunks = [
    jnp.pad(a, (0, pad), constant_values=fill).reshape(-1, pair_chunk)
    for a, fill in ((sorted_rows_P, n_rows), (token_P, 0), (coef_in_P, 0.0), (coef_out_P, 0.0))
  ]
  x_ND = x_ND.astype(jnp.float32)
  dy_ND = dy_ND.astype(jnp.float32)
  D = x_ND.shape[1]

  def step(acc, chunk):
    dw_in, dw_out, dbias = acc
    rows_c, token_c, cin_c, cout_c = chunk
    scatter = dict(indices_are_sorted=True, mode="drop")
    dw_in = dw_in.at[rows_c].add(cin_c[:, None] * x_ND[token_c], **scatter)
    dw_out = dw_out.at[rows_c].add(cout_c[:, None] * dy_ND[token_c], **scatter)
    if with_bias:
      dbias = dbias.at[rows_c].add(cin_c, **scatter)
    return (dw_in, dw_out, dbias), None

  zeros = jnp.zeros((n_rows, D), jnp.float32)
  init = (zeros, zeros, jnp.zeros((n_rows,), jnp.float32) if with_bias else None)
  (dw_in, dw_out, dbias), _ = jax.lax.scan(step, init, chunks)
  return dw_in, dw_out, dbias
