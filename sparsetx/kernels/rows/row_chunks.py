"""Hot rows cut into fixed chunks for the table-gradient kernels (FBGEMM's long/short segments).

A `segment_sums` program owns a block of consecutive rows and walks their pairs, so one row picked by
thousands of tokens (product-key routing makes such rows; FFF's roots take every token) holds its block for
all of them. Here every row keeps its first `chunk` pairs as a head segment, in place, and the rest of a long
row is cut into tail segments of `chunk` pairs packed after all heads. One kernel call sums every segment (no
program walks more than `chunk` pairs per segment), and a second sums each long row's head and tail partials in
a fixed order: deterministic, and rows of at most `chunk` pairs are written once, as before.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsetx import scopes


class RowChunks(NamedTuple):
  """Index arrays (int32) shared by every table of one backward pass.

  order_P: the sorted pair each new position takes (heads first, then tails); starts_V1: the V = R + T segments
  (R heads, then T tail chunks, unused ones empty at P); long_rows_M: rows with tail chunks (padding: distinct ids
  from R up); combine_*: per long row, its head partial then its tail partials, as the second call's pairs."""

  order_P: jax.Array
  starts_V1: jax.Array
  long_rows_M: jax.Array
  combine_tokens_Q: jax.Array
  combine_coefs_Q: jax.Array
  combine_starts_M1: jax.Array


def tail_segments(n_pairs: int, chunk: int) -> int:
  """Static bound on tail chunks: a long row of n > chunk pairs has ceil((n - chunk) / chunk) <= n // chunk."""
  return n_pairs // chunk if chunk > 0 else 0


def _exclusive_cumsum(a_R):
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(a_R, dtype=jnp.int32)])


def plan(sorted_rows_P, starts_R1, chunk: int) -> RowChunks:
  """The chunking of pairs sorted by row (sorted_rows_P, starts_R1 as segment_grads.row_starts gives them)."""
  n_pairs, n_rows = sorted_rows_P.shape[0], starts_R1.shape[0] - 1
  n_tails = tail_segments(n_pairs, chunk)
  n_long = min(n_rows, n_tails)
  count_R = starts_R1[1:] - starts_R1[:-1]
  head_R = jnp.minimum(count_R, chunk)
  tail_R = count_R - head_R
  chunks_R = (tail_R + chunk - 1) // chunk
  head_start_R1, tail_start_R1, chunk_start_R1 = (_exclusive_cumsum(a) for a in (head_R, tail_R, chunks_R))
  n_heads, n_chunks = head_start_R1[-1], chunk_start_R1[-1]

  # Each sorted pair's new position: its rank in the row decides head or tail.
  pair_P = jax.lax.iota(jnp.int32, n_pairs)
  rank_P = pair_P - starts_R1[sorted_rows_P]
  position_P = jnp.where(
    rank_P < chunk,
    head_start_R1[sorted_rows_P] + rank_P,
    n_heads + tail_start_R1[sorted_rows_P] + rank_P - chunk,
  )
  order_P = jnp.zeros((n_pairs,), jnp.int32).at[position_P].set(pair_P, unique_indices=True)

  # Tail segment v is chunk j of the row whose chunk range holds v.
  v_T = jax.lax.iota(jnp.int32, n_tails)
  row_T = jnp.clip(jnp.searchsorted(chunk_start_R1, v_T, side="right", method="scan_unrolled") - 1, 0, n_rows - 1)
  begin_T = n_heads + tail_start_R1[row_T] + (v_T - chunk_start_R1[row_T]) * chunk
  begin_T = jnp.where(v_T < n_chunks, begin_T, n_pairs)
  starts_V1 = jnp.concatenate([head_start_R1[:-1], begin_T, jnp.full((1,), n_pairs, jnp.int32)])

  # Long row i (in row order) takes entries [i + chunk_start[r_i], ... + 1 + chunks[r_i]) of the combine.
  i_M = jax.lax.iota(jnp.int32, n_long)
  is_long_R = chunks_R > 0
  found = jnp.sum(is_long_R, dtype=jnp.int32)
  (long_M,) = jnp.nonzero(is_long_R, size=n_long, fill_value=0)
  long_M = long_M.astype(jnp.int32)
  used = found + n_chunks
  cstart_M = jnp.where(i_M < found, i_M + chunk_start_R1[long_M], used)
  combine_starts_M1 = jnp.concatenate([cstart_M, used[None]])
  q_Q = jax.lax.iota(jnp.int32, n_long + n_tails)
  owner_Q = jnp.clip(jnp.searchsorted(cstart_M, q_Q, side="right", method="scan_unrolled") - 1, 0, max(n_long - 1, 0))
  offset_Q = q_Q - cstart_M[owner_Q]
  row_Q = long_M[owner_Q]
  token_Q = jnp.where(offset_Q == 0, row_Q, n_rows + chunk_start_R1[row_Q] + offset_Q - 1)
  live_Q = q_Q < used
  return RowChunks(
    order_P=order_P,
    starts_V1=starts_V1,
    long_rows_M=jnp.where(i_M < found, long_M, n_rows + i_M),  # distinct out-of-range ids: dropped by the set
    combine_tokens_Q=jnp.where(live_Q, token_Q, 0),
    combine_coefs_Q=live_Q.astype(jnp.float32),
    combine_starts_M1=combine_starts_M1,
  )


def _segmented_sums(values_Q, starts_M1):
  """[M] sums of values_Q over [starts[m], starts[m + 1]), by a segmented scan (a fixed tree: deterministic)."""
  n = values_Q.shape[0]
  first_Q = jnp.zeros((n,), jnp.bool_).at[starts_M1[:-1]].set(True, mode="drop")

  def add(a, b):
    (first_a, sum_a), (first_b, sum_b) = a, b
    return first_a | first_b, jnp.where(first_b, sum_b, sum_a + sum_b)

  _, running_Q = jax.lax.associative_scan(add, (first_Q, values_Q))
  last_M = starts_M1[1:] - 1
  in_range = (last_M >= starts_M1[:-1]) & (last_M < n)
  return jnp.where(in_range, running_Q[jnp.clip(last_M, 0, max(n - 1, 0))], 0.0)


def segment_sums(backend, values_ND, token_P, coef_P, sorted_rows_P, starts_R1, options, with_coef_sums, chunks=None):
  """backend.segment_sums with rows cut at `options.segment_chunk` pairs (0: whole rows, one call).

  `chunks` (plan's result) may be passed in to share one plan between tables."""
  n_rows = starts_R1.shape[0] - 1
  if tail_segments(token_P.shape[0], options.segment_chunk) == 0:
    return backend.segment_sums(values_ND, token_P, coef_P, starts_R1, options, with_coef_sums=with_coef_sums)
  chunks = plan(sorted_rows_P, starts_R1, options.segment_chunk) if chunks is None else chunks
  partial_VD, coef_partial_V = backend.segment_sums(
    values_ND, token_P[chunks.order_P], coef_P[chunks.order_P], chunks.starts_V1, options, with_coef_sums=with_coef_sums
  )
  with jax.named_scope(scopes.COMBINE):
    long_MD, _ = backend.segment_sums(
      partial_VD, chunks.combine_tokens_Q, chunks.combine_coefs_Q, chunks.combine_starts_M1, options
    )
    sums_RD = partial_VD[:n_rows].at[chunks.long_rows_M].set(long_MD, mode="drop", unique_indices=True)
    if not with_coef_sums:
      return sums_RD, None
    long_coef_M = _segmented_sums(
      coef_partial_V[chunks.combine_tokens_Q] * chunks.combine_coefs_Q, chunks.combine_starts_M1
    )
    coef_sums_R = coef_partial_V[:n_rows].at[chunks.long_rows_M].set(long_coef_M, mode="drop", unique_indices=True)
  return sums_RD, coef_sums_R
