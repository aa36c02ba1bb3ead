"""Fast XLA path of the gated gather: token-chunked forward and row-side backward.

No [tokens, S, D] tensor of gathered rows ever exists in full: a `lax.scan` walks chunks of
`token_chunk` tokens, gathers only that chunk's rows (small enough to stay in cache), dots, gates
and accumulates in float32. The backward pass re-gathers the rows chunk by chunk to produce dx,
the gate gradients and the per-pair coefficients the table gradients need (segment_grads.py).
Small chunks are the point on a CPU: their rows stay in cache. Elsewhere (`kernel.implementation=xla` on a
GPU or TPU) one chunk holds every token (kernels/platform.py), so no cache-sized loop reaches the device.

More: docs/modules.md, sparsetx/kernels/rows/xla_gather.py.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsetx.kernels import platform
from sparsetx.kernels.rows import segment_grads


def pad_rows(a, n_padded):
  """a with its leading axis zero-padded to n_padded."""
  pad = n_padded - a.shape[0]
  return a if pad == 0 else jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))


def chunked(arrays, chunk):
  """Pads the leading (token) axis to a multiple of chunk and splits it into [n_chunks, chunk, ...].

  Shared with tree_route's walk and sliced_gather.py, which scan token chunks the same way.
  """
  n = arrays[0].shape[0]
  n_padded = -(-n // chunk) * chunk
  return [pad_rows(a, n_padded).reshape((n_padded // chunk, chunk) + a.shape[1:]) for a in arrays]


def unchunk(a, n):
  """The inverse of `chunked` for one array: [n_chunks, chunk, ...] -> the first n of [n_chunks * chunk, ...]."""
  return a.reshape((-1,) + a.shape[2:])[:n]


def pre_activation(x_cD, w_in_RD, rows_cS, bias_R):
  """h [c, S] float32: <w_in[rows[t, s]], x[t]> (+ bias[rows[t, s]]), and the gathered rows in x's dtype."""
  w_in_cSD = w_in_RD[rows_cS].astype(x_cD.dtype)
  h_cS = jnp.einsum("cd,csd->cs", x_cD, w_in_cSD, preferred_element_type=jnp.float32)
  if bias_R is not None:
    h_cS = h_cS + bias_R[rows_cS].astype(jnp.float32)
  return h_cS, w_in_cSD


def weighted_rows(coef_cS, table_RD, rows_cS, dtype):
  """[c, D] float32: sum_s coef[t, s] * table[rows[t, s]], both factors in `dtype`."""
  table_cSD = table_RD[rows_cS].astype(dtype)
  return jnp.einsum("cs,csd->cd", coef_cS.astype(dtype), table_cSD, preferred_element_type=jnp.float32)


def _scan_chunks(step, arrays, options):
  """[N, ...]: step(*chunk) over the tokens in `platform.cpu_chunk(options.token_chunk)` chunks."""
  n_tokens = arrays[0].shape[0]
  _, out = jax.lax.scan(
    lambda _, chunk: (None, step(*chunk)), None, chunked(arrays, platform.cpu_chunk(options.token_chunk, n_tokens))
  )
  return unchunk(out, n_tokens)


def chunked_dots(lhs_ND, table_RD, rows_NS, options):
  """[N, S] float32: <lhs[t], table[rows[t, s]]> (rows rounded to lhs's dtype), token chunk by chunk."""
  return _scan_chunks(
    lambda a_cD, rows_cS: pre_activation(a_cD, table_RD, rows_cS, None)[0], [lhs_ND, rows_NS], options
  )


def chunked_sums(coef_NS, table_RD, rows_NS, dtype, options):
  """[N, D] float32: sum_s coef[t, s] * table[rows[t, s]], both factors in `dtype`, token chunk by chunk."""
  step = lambda coef_cS, rows_cS: weighted_rows(coef_cS, table_RD, rows_cS, dtype)  # noqa: E731
  return _scan_chunks(step, [coef_NS, rows_NS], options)


def forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  """Returns y [N, D] (x's dtype) and the pre-activations h [N, S] (float32, kept for backward).

  `gating` (reference.Gating) turns (h, gate) into the slot coefficient that multiplies w_out's row."""
  n_tokens = x_ND.shape[0]
  dtype = x_ND.dtype

  def step(_, chunk):
    x_cD, rows_cS, gates_cS = chunk
    h_cS, _ = pre_activation(x_cD, w_in_RD, rows_cS, bias_R)
    a_cS = gating.value(h_cS, gates_cS.astype(jnp.float32)).astype(dtype)
    y_cD = weighted_rows(a_cS, w_out_RD, rows_cS, dtype)
    return None, (y_cD.astype(dtype), h_cS)

  _, (y, h) = jax.lax.scan(
    step, None, chunked([x_ND, rows_NS, gates_NS], platform.cpu_chunk(options.token_chunk, n_tokens))
  )
  return unchunk(y, n_tokens), unchunk(h, n_tokens)


def forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
  """y [N, D] (x's dtype) from given pre-activations h [N, S]: only w_out rows are gathered."""
  n_tokens = x_ND.shape[0]
  dtype = x_ND.dtype

  def step(_, chunk):
    rows_cS, gates_cS, h_cS = chunk
    a_cS = gating.value(h_cS, gates_cS.astype(jnp.float32)).astype(dtype)
    y_cD = weighted_rows(a_cS, w_out_RD, rows_cS, dtype)
    return None, y_cD.astype(dtype)

  _, y = jax.lax.scan(step, None, chunked([rows_NS, gates_NS, h_NS], platform.cpu_chunk(options.token_chunk, n_tokens)))
  return unchunk(y, n_tokens)


def backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
  """Token-side gradients from one more chunked gather pass.

  Returns dx [N, D] (dy's dtype), dgates [N, S], and the float32 per-pair coefficients
  coef_in = dL/dh (multiplies x into w_in's rows) and coef_out = the slot coefficient a(h, gate)
  (multiplies dy into w_out's rows).
  """
  n_tokens = dy_ND.shape[0]
  dtype = dy_ND.dtype

  def step(_, chunk):
    dy_cD, h_cS, rows_cS, gates_cS = chunk
    dyw_cS, _ = pre_activation(dy_cD, w_out_RD, rows_cS, None)
    a_cS, da_dh_cS, da_dg_cS = gating.value_and_slopes(h_cS, gates_cS.astype(jnp.float32))
    coef_in_cS = da_dh_cS * dyw_cS
    dx_cD = weighted_rows(coef_in_cS, w_in_RD, rows_cS, dtype)
    return None, (dx_cD.astype(dtype), da_dg_cS * dyw_cS, coef_in_cS, a_cS)

  chunks = chunked([dy_ND, h_NS, rows_NS, gates_NS], platform.cpu_chunk(options.token_chunk, n_tokens))
  _, outs = jax.lax.scan(step, None, chunks)
  return tuple(unchunk(a, n_tokens) for a in outs)


# Row-sorted path (KernelOptions.row_sorted): pairs are walked in table-row order, so each picked row is read
# from DRAM about once per batch and the random accesses go to x, y, dx and dy (a few MiB, cache-resident).


def row_sorted_fits(n_tokens, n_rows):
  """Whether the packed (row, token) sort key fits int32 (else callers use the token-order path)."""
  return segment_grads.packs_in_int32(n_rows, n_tokens)


class RowOrder(NamedTuple):
  """(token, slot) pairs sorted by (row, token), padded to whole chunks of `pair_chunk`.

  rows_P / tokens_P / gates_P are in sorted order (padding: row R, token 0, gate 0); position_NS maps each
  (token, slot) to its sorted position. A row picked twice by one token (a shared PEER table) sorts to two
  equal keys. With `merge_duplicates` (a gating linear in the gate: g * act(h), or the identity) both slots
  map to the first one, which carries the summed gate, and the second gets gate 0; otherwise (act(g * h))
  each slot takes its own position, the first plus its rank among the token's earlier slots on that row.
  """

  rows_P: jax.Array
  tokens_P: jax.Array
  gates_P: jax.Array
  position_NS: jax.Array


def row_order(rows_NS, gates_NS, n_rows, pair_chunk, merge_duplicates=True):
  """Sorts the pairs by row with one single-key int32 sort (cheaper than a key-value sort)."""
  n_tokens, n_slots = rows_NS.shape
  key_NS = segment_grads.packed_keys(rows_NS, jax.lax.iota(jnp.int32, n_tokens)[:, None], n_tokens)
  sorted_key_P = jax.lax.sort(key_NS.reshape(-1), is_stable=False)
  position_NS = jnp.searchsorted(sorted_key_P, key_NS.reshape(-1)).astype(jnp.int32).reshape(n_tokens, n_slots)
  gates_NS = gates_NS.astype(jnp.float32)
  if not merge_duplicates:
    earlier_SS = jnp.tril(jnp.ones((n_slots, n_slots), jnp.bool_), -1)  # [s, s']: s' < s
    same_NSS = rows_NS[:, :, None] == rows_NS[:, None, :]
    position_NS = position_NS + jnp.sum(same_NSS & earlier_SS[None], axis=-1, dtype=jnp.int32)
  position_P = position_NS.reshape(-1)
  gates_P = jnp.zeros(sorted_key_P.shape, jnp.float32).at[position_P].add(gates_NS.reshape(-1))
  n_pairs = n_tokens * n_slots
  pad = -(-n_pairs // pair_chunk) * pair_chunk - n_pairs
  return RowOrder(
    rows_P=jnp.pad(sorted_key_P // n_tokens, (0, pad), constant_values=n_rows),
    tokens_P=jnp.pad(sorted_key_P % n_tokens, (0, pad)),
    gates_P=jnp.pad(gates_P, (0, pad)),
    position_NS=position_NS,
  )


def _pair_chunks(arrays, pair_chunk):
  return [a.reshape((-1, pair_chunk) + a.shape[1:]) for a in arrays]


def _in_dtype(a, dtype):
  """float32 values rounded to the compute dtype first, where the token-order path multiplies in that dtype."""
  return a.astype(dtype).astype(jnp.float32)


def row_sorted_forward(x_ND, w_in_RD, w_out_RD, order, bias_R, gating, options):
  """y [N, D] (x's dtype) and the float32 pre-activations in sorted order h_P, walking the table by row."""
  dtype = x_ND.dtype
  gather = dict(mode="clip")
  scatter = dict(mode="drop")

  def step(y_ND, chunk):
    rows_c, tokens_c, gates_c = chunk
    x_cD = x_ND.at[tokens_c].get(**gather).astype(jnp.float32)
    h_c = jnp.sum(_in_dtype(w_in_RD.at[rows_c].get(**gather), dtype) * x_cD, axis=-1)
    if bias_R is not None:
      h_c = h_c + bias_R.at[rows_c].get(**gather).astype(jnp.float32)
    a_c = _in_dtype(gating.value(h_c, gates_c), dtype)
    y_ND = y_ND.at[tokens_c].add(a_c[:, None] * _in_dtype(w_out_RD.at[rows_c].get(**gather), dtype), **scatter)
    return y_ND, h_c

  chunks = _pair_chunks([order.rows_P, order.tokens_P, order.gates_P], options.pair_chunk)
  y_ND, h_P = jax.lax.scan(step, jnp.zeros(x_ND.shape, jnp.float32), chunks)
  return y_ND.astype(x_ND.dtype), h_P.reshape(-1)


def row_sorted_backward(dy_ND, x_ND, h_P, w_in_RD, w_out_RD, order, with_bias, gating, options):
  """(dx [N, D], dgates [N, S], dW_in [R, D], dW_out [R, D], dbias [R] or None), float32, in one row-order pass.

  Per sorted pair, a = a(h, gate) the slot coefficient (reference.Gating): dyw = <dy[t], w_out[r]>,
  coef_in = da/dh * dyw; dx[t] += coef_in * w_in[r], dW_in[r] += coef_in * x[t], dW_out[r] += a * dy[t],
  and dgate = da/dgate * dyw.
  """
  n_rows, D = w_in_RD.shape
  dtype = dy_ND.dtype
  gather = dict(mode="clip")
  scatter = dict(mode="drop")
  rows_scatter = dict(mode="drop", indices_are_sorted=True)

  def step(acc, chunk):
    dx_ND, dw_in, dw_out, dbias = acc
    rows_c, tokens_c, gates_c, h_c = chunk
    dy_cD = dy_ND.at[tokens_c].get(**gather).astype(jnp.float32)
    x_cD = x_ND.at[tokens_c].get(**gather).astype(jnp.float32)
    dyw_c = jnp.sum(_in_dtype(w_out_RD.at[rows_c].get(**gather), dtype) * dy_cD, axis=-1)
    a_c, da_dh_c, da_dg_c = gating.value_and_slopes(h_c, gates_c)
    coef_in_c = da_dh_c * dyw_c
    w_in_cD = _in_dtype(w_in_RD.at[rows_c].get(**gather), dtype)
    dx_ND = dx_ND.at[tokens_c].add(_in_dtype(coef_in_c, dtype)[:, None] * w_in_cD, **scatter)
    dw_in = dw_in.at[rows_c].add(coef_in_c[:, None] * x_cD, **rows_scatter)
    dw_out = dw_out.at[rows_c].add(a_c[:, None] * dy_cD, **rows_scatter)
    if with_bias:
      dbias = dbias.at[rows_c].add(coef_in_c, **rows_scatter)
    return (dx_ND, dw_in, dw_out, dbias), da_dg_c * dyw_c

  zeros_RD = jnp.zeros((n_rows, D), jnp.float32)
  dbias_R = jnp.zeros((n_rows,), jnp.float32) if with_bias else None
  init = (jnp.zeros(dy_ND.shape, jnp.float32), zeros_RD, zeros_RD, dbias_R)
  chunks = _pair_chunks([order.rows_P, order.tokens_P, order.gates_P, h_P], options.pair_chunk)
  (dx_ND, dw_in, dw_out, dbias), dgate_P = jax.lax.scan(step, init, chunks)
  dgates_NS = dgate_P.reshape(-1)[order.position_NS]
  return dx_ND, dgates_NS, dw_in, dw_out, dbias
