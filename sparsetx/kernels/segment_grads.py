"""Table gradients of the gated gather by sorting (token, slot) pairs by row and summing segments.

dW_in[r] = sum over pairs (t, s) with rows[t, s] == r of coef_in[t, s] * x[t], and likewise for
W_out with dy. Pairs are sorted by row once (shared by both tables and the bias); a `lax.scan`
over chunks of sorted pairs then adds each chunk into float32 accumulators with
`indices_are_sorted=True`. Sorted order keeps the accumulator rows being written close together
(faster than the unsorted scatter-add: docs/kernels.md), the result is deterministic, and nothing is
ever accumulated in bf16.
"""

import jax
import jax.numpy as jnp

_INT32_LIMIT = 2**31 - 1


def sort_pairs(rows_P, n_rows):
  """Pair ids ordered by row (ties in any fixed order) and the rows in that order."""
  n_pairs = rows_P.shape[0]
  rows_P = rows_P.astype(jnp.int32)
  pair_P = jax.lax.iota(jnp.int32, n_pairs)
  if n_rows * n_pairs <= _INT32_LIMIT:
    # One packed key sorts much faster than a (key, value) pair on CPU.
    packed_P = jax.lax.sort(rows_P * n_pairs + pair_P, is_stable=False)
    return packed_P % n_pairs, packed_P // n_pairs
  sorted_rows_P, order_P = jax.lax.sort((rows_P, pair_P), num_keys=1, is_stable=False)
  return order_P, sorted_rows_P


def table_grads(x_ND, dy_ND, rows_NS, coef_in_NS, coef_out_NS, n_rows, pair_chunk, with_bias):
  """(dW_in [R, D], dW_out [R, D], dbias [R] or None), all float32."""
  n_tokens, n_slots = rows_NS.shape
  n_pairs = n_tokens * n_slots
  order_P, sorted_rows_P = sort_pairs(rows_NS.reshape(-1), n_rows)
  token_P = order_P // n_slots
  coef_in_P = coef_in_NS.reshape(-1)[order_P]
  coef_out_P = coef_out_NS.reshape(-1)[order_P]

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
