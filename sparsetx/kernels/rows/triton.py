"""Pallas GPU kernels of the gated gather (Triton lowering): the row kernels every backend provides.

Row kernels (the interface every GPU/TPU backend shares; callers compose the gather's passes from them):

  row_dots:        dots[s, t] = <lhs[t], table[rows[s, t]]>            one program per block of tokens
  row_accumulate:  out[t]     = sum_s coef[s, t] * table[rows[s, t]]    one program per (token block, d chunk)
  segment_sums:    sums[r]    = sum_{p in row r} coefs[p] * values[tokens[p]]   (the table gradient)

More: docs/modules.md, sparsetx/kernels/rows/triton.py.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from sparsetx.kernels import device


def _next_pow2(n):
  return 1 << max(0, (n - 1).bit_length())


SEGMENT_ROWS = 16  # segment_sums: table rows one program owns (a power of two)


def _round_up(n, multiple):
  return -(-n // multiple) * multiple


def _d_chunk(d_model, options):
  """The d_model chunk a load moves: the largest power of two <= kernel.block_d that divides d_model."""
  chunk = 1
  while 2 * chunk <= options.block_d and d_model % (2 * chunk) == 0:
    chunk *= 2
  return chunk


def _token_blocks(n_tokens, options, *arrays_SN):
  """Block size (a power of two), padded token count and the per-slot [S, N] arrays padded to it (row 0, zeros)."""
  bt = _next_pow2(options.block_tokens)
  n_padded = _round_up(n_tokens, bt)
  return bt, n_padded, [jnp.pad(a, ((0, 0), (0, n_padded - n_tokens))) for a in arrays_SN]


def row_dots(lhs_ND, table_RD, rows_SN, options):
  """dots [S, N] float32: <lhs[t], table[rows[s, t]]>, table rows rounded to lhs's dtype, float32 sums."""
  n_tokens, d_model = lhs_ND.shape
  n_slots = rows_SN.shape[0]
  dtype = lhs_ND.dtype
  bt, n_padded, (rows_Sp,) = _token_blocks(n_tokens, options, rows_SN.astype(jnp.int32))
  lhs_pD = jnp.pad(lhs_ND, ((0, n_padded - n_tokens), (0, 0)))
  chunk = _d_chunk(d_model, options)

  def kernel(lhs_ref, rows_ref, table_ref, dots_ref):
    def slot(s, carry):
      rows_b = rows_ref[s, :]
      dots_b = jnp.zeros((bt,), jnp.float32)
      for c in range(0, d_model, chunk):  # unrolled: the chunks' gathers are independent loads in flight
        lhs_bC = lhs_ref[:, pl.ds(c, chunk)].astype(jnp.float32)
        table_bC = table_ref[rows_b, pl.ds(c, chunk)].astype(dtype).astype(jnp.float32)
        dots_b = dots_b + jnp.sum(lhs_bC * table_bC, axis=1)
      dots_ref[s, :] = dots_b
      return carry

    jax.lax.fori_loop(0, n_slots, slot, 0)

  dots_Sp = pl.pallas_call(
    kernel,
    grid=(n_padded // bt,),
    in_specs=[
      pl.BlockSpec((bt, d_model), lambda i: (i, 0)),
      pl.BlockSpec((n_slots, bt), lambda i: (0, i)),
      pl.BlockSpec(table_RD.shape, lambda i: (0, 0)),
    ],
    out_specs=pl.BlockSpec((n_slots, bt), lambda i: (0, i)),
    out_shape=jax.ShapeDtypeStruct((n_slots, n_padded), jnp.float32),
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="row_dots",
  )(lhs_pD, rows_Sp, table_RD)
  return dots_Sp[:, :n_tokens]


def row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, options):
  """out [N, D] in out_dtype: sum_s coef[s, t] * table[rows[s, t]] (rows rounded to out_dtype, float32 sums)."""
  n_slots, n_tokens = coef_SN.shape
  n_rows, d_model = table_RD.shape
  out_dtype = jnp.dtype(out_dtype)
  bt, n_padded, (coef_Sp, rows_Sp) = _token_blocks(
    n_tokens, options, coef_SN.astype(jnp.float32), rows_SN.astype(jnp.int32)
  )
  chunk = _d_chunk(d_model, options)

  def kernel(coef_ref, rows_ref, table_ref, out_ref):
    def slot(s, acc_bC):
      table_bC = table_ref[rows_ref[s, :], :].astype(out_dtype).astype(jnp.float32)
      return acc_bC + coef_ref[s, :][:, None] * table_bC

    out_ref[...] = jax.lax.fori_loop(0, n_slots, slot, jnp.zeros((bt, chunk), jnp.float32)).astype(out_dtype)

  slot_block = pl.BlockSpec((n_slots, bt), lambda i, j: (0, i))
  out_pD = pl.pallas_call(
    kernel,
    grid=(n_padded // bt, d_model // chunk),
    in_specs=[slot_block, slot_block, pl.BlockSpec((n_rows, chunk), lambda i, j: (0, j))],
    out_specs=pl.BlockSpec((bt, chunk), lambda i, j: (i, j)),
    out_shape=jax.ShapeDtypeStruct((n_padded, d_model), out_dtype),
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="row_accumulate",
  )(coef_Sp, rows_Sp, table_RD)
  return out_pD[:n_tokens]


def segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
  """(sums [R, D] float32, coef sums [R] float32 or None) of pairs sorted by row: row r owns the pairs
  [starts[r], starts[r + 1]); sums[r] = sum coefs[p] * values[tokens[p]], coef_sums[r] = sum coefs[p]."""
  n_tokens, d_model = values_ND.shape
  n_rows = starts_R1.shape[0] - 1
  tile = SEGMENT_ROWS
  r_padded = max(tile, _round_up(n_rows, tile))
  starts_R1 = starts_R1.astype(jnp.int32)
  # Padding rows own no pairs; a pair array is never empty (a zero-size operand has no pointer to load from).
  begins_R, ends_R = (jnp.pad(a, (0, r_padded - n_rows)) for a in (starts_R1[:-1], starts_R1[1:]))
  n_pairs = max(1, tokens_P.shape[0])
  tokens_P, coefs_P = (jnp.pad(a, (0, n_pairs - a.shape[0])) for a in (tokens_P.astype(jnp.int32), coefs_P))
  coefs_P = coefs_P.astype(jnp.float32)
  chunk = _d_chunk(d_model, options)

  def kernel(begins_ref, ends_ref, tokens_ref, coefs_ref, values_ref, sums_ref, *coef_sums_ref):
    begins_T, ends_T = begins_ref[...], ends_ref[...]
    columns_1C = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

    def pair(k, carry):
      sums_TC, coef_sums_T = carry
      p_T = begins_T + k
      live_T = p_T < ends_T  # rows shorter than k + 1 pairs add exact zeros (masked loads, nothing read)
      token_T = pltriton.load(tokens_ref.at[p_T], mask=live_T, other=0)
      coef_T = pltriton.load(coefs_ref.at[p_T], mask=live_T, other=0.0)
      live_TC = jnp.broadcast_to(live_T[:, None], (tile, chunk))
      values_TC = pltriton.load(values_ref.at[token_T[:, None], columns_1C], mask=live_TC, other=0.0)
      return sums_TC + coef_T[:, None] * values_TC.astype(jnp.float32), coef_sums_T + coef_T

    init = (jnp.zeros((tile, chunk), jnp.float32), jnp.zeros((tile,), jnp.float32))
    sums_TC, coef_sums_T = jax.lax.fori_loop(0, jnp.max(ends_T - begins_T), pair, init)
    sums_ref[...] = sums_TC
    if with_coef_sums:

      @pl.when(pl.program_id(1) == 0)  # one d chunk's program writes them
      def _():
        coef_sums_ref[0][...] = coef_sums_T

  row_block = pl.BlockSpec((tile,), lambda i, j: (i,))
  whole_pairs = pl.BlockSpec((n_pairs,), lambda i, j: (0,))
  out_specs = [pl.BlockSpec((tile, chunk), lambda i, j: (i, j))]
  out_shape = [jax.ShapeDtypeStruct((r_padded, d_model), jnp.float32)]
  if with_coef_sums:
    out_specs.append(row_block)
    out_shape.append(jax.ShapeDtypeStruct((r_padded,), jnp.float32))
  outs = pl.pallas_call(
    kernel,
    grid=(r_padded // tile, d_model // chunk),
    in_specs=[row_block, row_block, whole_pairs, whole_pairs, pl.BlockSpec((n_tokens, chunk), lambda i, j: (0, j))],
    out_specs=out_specs,
    out_shape=out_shape,
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="segment_sums",
  )(begins_R, ends_R, tokens_P, coefs_P, values_ND)
  sums_RD = outs[0][:n_rows]
  return sums_RD, (outs[1][:n_rows] if with_coef_sums else None)


def row_order_dots(lhs_ND, table_RD, tokens_P, rows_P, starts_R1, options):
  """dots [P] float32 of pairs sorted by row (rows [P], unused: a program knows its rows): row r owns the pairs
  [starts[r], starts[r + 1]) and
  dots[p] = <lhs[tokens[p]], table[r]>, the table's rows rounded to lhs's dtype, float32 sums. One program per tile
  of SEGMENT_ROWS rows walks its rows' pairs side by side, so a picked row is read by one program only (its later
  reads hit the cache) while the tokens' rows come from L2; each pair's dot is written once (no atomics)."""
  del rows_P
  n_tokens, d_model = lhs_ND.shape
  n_rows = starts_R1.shape[0] - 1
  dtype = lhs_ND.dtype
  tile = SEGMENT_ROWS
  r_padded = max(tile, _round_up(n_rows, tile))
  starts_R1 = starts_R1.astype(jnp.int32)
  begins_R, ends_R = (jnp.pad(a, (0, r_padded - n_rows)) for a in (starts_R1[:-1], starts_R1[1:]))
  n_real = tokens_P.shape[0]
  n_pairs = max(1, n_real)  # a zero-size operand has no pointer to load from
  tokens_P = jnp.pad(tokens_P.astype(jnp.int32), (0, n_pairs - n_real))
  table_pD = jnp.pad(table_RD, ((0, r_padded - n_rows), (0, 0)))
  chunk = _d_chunk(d_model, options)

  def kernel(begins_ref, ends_ref, tokens_ref, lhs_ref, table_ref, dots_ref):
    begins_T, ends_T = begins_ref[...], ends_ref[...]
    spare_T = n_pairs + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)  # each lane's own slot past the pairs

    def pair(k, carry):
      p_T = begins_T + k
      live_T = p_T < ends_T
      token_T = pltriton.load(tokens_ref.at[p_T], mask=live_T, other=0)
      live_TC = jnp.broadcast_to(live_T[:, None], (tile, chunk))
      dots_T = jnp.zeros((tile,), jnp.float32)
      for c in range(0, d_model, chunk):  # unrolled: the chunks' loads are independent
        columns_1C = c + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        lhs_TC = pltriton.load(lhs_ref.at[token_T[:, None], columns_1C], mask=live_TC, other=0.0)
        table_TC = table_ref[:, pl.ds(c, chunk)].astype(dtype).astype(jnp.float32)
        dots_T = dots_T + jnp.sum(lhs_TC.astype(jnp.float32) * table_TC, axis=1)
      # A finished row's lane stores to its spare slot: its p may be a live pair of the next row in the tile.
      pltriton.store(dots_ref.at[jnp.where(live_T, p_T, spare_T)], dots_T, mask=live_T)
      return carry

    jax.lax.fori_loop(0, jnp.max(ends_T - begins_T), pair, 0)

  row_block = pl.BlockSpec((tile,), lambda i: (i,))
  dots_P = pl.pallas_call(
    kernel,
    grid=(r_padded // tile,),
    in_specs=[
      row_block,
      row_block,
      pl.BlockSpec((n_pairs,), lambda i: (0,)),
      pl.BlockSpec((n_tokens, d_model), lambda i: (0, 0)),
      pl.BlockSpec((tile, d_model), lambda i: (i, 0)),
    ],
    out_specs=pl.BlockSpec((n_pairs + tile,), lambda i: (0,)),
    out_shape=jax.ShapeDtypeStruct((n_pairs + tile,), jnp.float32),
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="row_order_dots",
  )(begins_R, ends_R, tokens_P, lhs_ND, table_pD)
  return dots_P[:n_real]


def fused_forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  """y [N, D] (x's dtype) and h [N, S] float32 in one kernel, one program per block of tokens: per slot the dots
  of x with w_in's rows (+ bias), the gating (reference.Gating: a = act(g h) or g act(h), rounded to x's dtype) and
  a * w_out's rows added to the block's float32 sums, which stay in registers (block_tokens x d_model) until the
  block's y is written. Rows are rounded to x's dtype, as row_dots and row_accumulate round them."""
  n_tokens, d_model = x_ND.shape
  n_slots = rows_NS.shape[1]
  dtype = x_ND.dtype
  with_bias = bias_R is not None
  per_slot = [rows_NS.T.astype(jnp.int32), gates_NS.T.astype(jnp.float32)]
  if with_bias:
    per_slot.append(bias_R[rows_NS].T.astype(jnp.float32))  # N x S scalars, gathered before the kernel
  bt, n_padded, per_slot = _token_blocks(n_tokens, options, *per_slot)
  x_pD = jnp.pad(x_ND, ((0, n_padded - n_tokens), (0, 0)))
  chunk = _d_chunk(d_model, options)
  columns = range(0, d_model, chunk)

  def kernel(x_ref, rows_ref, gates_ref, *refs):
    bias_ref = refs[0] if with_bias else None
    w_in_ref, w_out_ref, y_ref, h_ref = refs[with_bias:]

    def slot(s, sums):
      rows_b = rows_ref[s, :]
      h_b = jnp.zeros((bt,), jnp.float32)
      for c in columns:  # unrolled: the chunks' gathers are independent loads in flight
        x_bC = x_ref[:, pl.ds(c, chunk)].astype(jnp.float32)
        w_in_bC = w_in_ref[rows_b, pl.ds(c, chunk)].astype(dtype).astype(jnp.float32)
        h_b = h_b + jnp.sum(x_bC * w_in_bC, axis=1)
      if with_bias:
        h_b = h_b + bias_ref[s, :]
      h_ref[s, :] = h_b
      a_b1 = gating.value(h_b, gates_ref[s, :]).astype(dtype).astype(jnp.float32)[:, None]
      return tuple(
        total + a_b1 * w_out_ref[rows_b, pl.ds(c, chunk)].astype(dtype).astype(jnp.float32)
        for total, c in zip(sums, columns)
      )

    sums = jax.lax.fori_loop(0, n_slots, slot, (jnp.zeros((bt, chunk), jnp.float32),) * len(columns))
    for total, c in zip(sums, columns):
      y_ref[:, pl.ds(c, chunk)] = total.astype(dtype)

  slot_block = pl.BlockSpec((n_slots, bt), lambda i: (0, i))
  table = pl.BlockSpec(w_in_RD.shape, lambda i: (0, 0))
  y_pD, h_Sp = pl.pallas_call(
    kernel,
    grid=(n_padded // bt,),
    in_specs=[pl.BlockSpec((bt, d_model), lambda i: (i, 0)), *[slot_block] * len(per_slot), table, table],
    out_specs=[pl.BlockSpec((bt, d_model), lambda i: (i, 0)), slot_block],
    out_shape=[
      jax.ShapeDtypeStruct((n_padded, d_model), dtype),
      jax.ShapeDtypeStruct((n_slots, n_padded), jnp.float32),
    ],
    interpret=device.interpret_off("gpu", options),
    compiler_params=pltriton.CompilerParams(),
    name="fused_forward",
  )(x_pD, *per_slot, w_in_RD, w_out_RD)
  return y_pD[:n_tokens], h_Sp[:, :n_tokens].T
