"""Pallas TPU (Mosaic) row kernels of the sparse layers, composed in row_gather.py (the gated gather's passes,
FFF's walk levels, the d-split's partial dots) and segment_grads.py (the table gradients).

More: docs/modules.md, sparsetx/kernels/rows/tpu.py.
"""

import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparsetx.kernels.rows.tpu_layout import (
  LANES,
  ROW_BLOCK,
  TOKEN_GROUP,
  as_words,
  columns,
  double_buffered_rows,
  interpret_params,
  row_layout,
  slot_bytes,
  split_columns,
  word_layout,
)


def _token_dots(dots_S1, lhs_parts, row_words_SW, per_word, dtype, sublane, t):
  """dots_S1 plus token t's dots with its step's rows ([S, words] of one token): the lhs block's row t taken exactly
  (a masked sum), the rows rounded to the lhs's dtype, each column part's products summed in float32."""
  for lhs, rows_SW in zip(lhs_parts, columns(row_words_SW, per_word)):
    lhs_1W = jnp.sum(jnp.where(sublane == t, lhs, 0.0), axis=0, keepdims=True)  # row t, exactly
    rows_SW = rows_SW.astype(dtype).astype(jnp.float32) if per_word == 1 else rows_SW
    dots_S1 = dots_S1 + jnp.sum(rows_SW * lhs_1W, axis=1, keepdims=True)
  return dots_S1


def _token_sum(outs, coef_S1, row_words_SW, per_word, dtype, sublane, t):
  """The out blocks with row t set to sum_s coef[s] * rows[s] (rows rounded to `dtype`, float32 sums), per part."""
  new = []
  for out, rows_SW in zip(outs, columns(row_words_SW, per_word)):
    rows_SW = rows_SW.astype(dtype).astype(jnp.float32) if per_word == 1 else rows_SW
    new.append(jnp.where(sublane == t, jnp.sum(coef_S1 * rows_SW, axis=0, keepdims=True), out))
  return tuple(new)


def row_dots(lhs_ND, table_RD, rows_SN, options):
  """dots [S, N] float32: <lhs[t], table[rows[s, t]]>, table rows rounded to lhs's dtype, summed in float32."""
  n_tokens, d_model = lhs_ND.shape
  n_slots = rows_SN.shape[0]
  dtype = lhs_ND.dtype
  interpret = interpret_params(options)
  table_RW, per_word, words, dc, steps = row_layout(n_tokens, d_model, n_slots, table_RD, interpret)
  lhs_parts = [
    jnp.pad(part, [(0, steps.n_padded - n_tokens), (0, 0)]) for part in split_columns(lhs_ND, per_word, words)
  ]
  rows_pS = jnp.pad(rows_SN.T.astype(jnp.int32), [(0, steps.n_padded - n_tokens), (0, 0)])
  per_group = TOKEN_GROUP // ROW_BLOCK

  def kernel(this_rows, next_rows, *refs):
    *lhs_refs, table_hbm, dots_ref, buf, sem = refs
    q, slot = double_buffered_rows(steps, n_tokens, n_slots, dc, table_hbm, this_rows, next_rows, buf, sem)
    b, c = steps.block(q), steps.chunk(q)

    @pl.when(jnp.logical_and(b % per_group == 0, c == 0))
    def _():
      dots_ref[...] = jnp.zeros(dots_ref.shape, jnp.float32)

    @pl.when(b * ROW_BLOCK < n_tokens)
    def _():
      lane = jax.lax.broadcasted_iota(jnp.int32, (n_slots, TOKEN_GROUP), 1)
      sublane = jax.lax.broadcasted_iota(jnp.int32, (ROW_BLOCK, dc), 0)
      first = (b % per_group) * ROW_BLOCK
      lhs_bW = [ref[...].astype(jnp.float32) for ref in lhs_refs]

      def token(t, dots):
        dots_S1 = _token_dots(jnp.zeros((n_slots, 1), jnp.float32), lhs_bW, buf[slot, t], per_word, dtype, sublane, t)
        return dots + jnp.where(lane == first + t, dots_S1, 0.0)

      dots_ref[...] = jax.lax.fori_loop(0, ROW_BLOCK, token, dots_ref[...])

  dots_SN = pl.pallas_call(
    kernel,
    grid=steps.grid,
    in_specs=[
      *steps.rows_specs(n_slots),
      *[steps.token_spec(dc)] * per_word,
      pl.BlockSpec(memory_space=pl.ANY),
    ],
    out_specs=steps.group_spec(n_slots),
    out_shape=jax.ShapeDtypeStruct((n_slots, steps.n_padded), jnp.float32),
    scratch_shapes=[pltpu.VMEM((2, ROW_BLOCK, n_slots, dc), table_RW.dtype), pltpu.SemaphoreType.DMA((2,))],
    compiler_params=steps.params(),
    interpret=interpret,
    name="row_dots",
  )(rows_pS, rows_pS, *lhs_parts, table_RW)
  return dots_SN[:, :n_tokens]


def row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, options):
  """out [N, D] in out_dtype: sum_s coef[s, t] * table[rows[s, t]] (rows rounded to out_dtype, float32 sums)."""
  n_slots, n_tokens = coef_SN.shape
  d_model = table_RD.shape[1]
  out_dtype = jnp.dtype(out_dtype)
  interpret = interpret_params(options)
  table_RW, per_word, words, dc, steps = row_layout(n_tokens, d_model, n_slots, table_RD, interpret)
  coef_Sp = jnp.pad(coef_SN.astype(jnp.float32), [(0, 0), (0, steps.n_padded - n_tokens)])
  rows_pS = jnp.pad(rows_SN.T.astype(jnp.int32), [(0, steps.n_padded - n_tokens), (0, 0)])
  per_group = TOKEN_GROUP // ROW_BLOCK

  def kernel(this_rows, next_rows, coef_ref, table_hbm, *refs):
    *out_refs, buf, sem = refs
    q, slot = double_buffered_rows(steps, n_tokens, n_slots, dc, table_hbm, this_rows, next_rows, buf, sem)
    b = steps.block(q)

    @pl.when(b * ROW_BLOCK < n_tokens)
    def _():
      lane = jax.lax.broadcasted_iota(jnp.int32, (n_slots, TOKEN_GROUP), 1)
      sublane = jax.lax.broadcasted_iota(jnp.int32, (ROW_BLOCK, dc), 0)
      first = (b % per_group) * ROW_BLOCK
      coef_SG = coef_ref[...]

      def token(t, outs):
        coef_S1 = jnp.sum(jnp.where(lane == first + t, coef_SG, 0.0), axis=1, keepdims=True)  # column t, exactly
        return _token_sum(outs, coef_S1, buf[slot, t], per_word, out_dtype, sublane, t)

      zeros = (jnp.zeros((ROW_BLOCK, dc), jnp.float32),) * per_word
      for out_ref, out in zip(out_refs, jax.lax.fori_loop(0, ROW_BLOCK, token, zeros)):
        out_ref[...] = out.astype(out_dtype)

  parts = pl.pallas_call(
    kernel,
    grid=steps.grid,
    in_specs=[*steps.rows_specs(n_slots), steps.group_spec(n_slots), pl.BlockSpec(memory_space=pl.ANY)],
    out_specs=[steps.token_spec(dc)] * per_word,
    out_shape=[jax.ShapeDtypeStruct((steps.n_padded, words), out_dtype)] * per_word,
    scratch_shapes=[pltpu.VMEM((2, ROW_BLOCK, n_slots, dc), table_RW.dtype), pltpu.SemaphoreType.DMA((2,))],
    compiler_params=steps.params(),
    interpret=interpret,
    name="row_accumulate",
  )(rows_pS, rows_pS, coef_Sp, table_RW)
  out_pD = parts[0] if per_word == 1 else jnp.stack(parts, axis=-1).reshape(steps.n_padded, 2 * words)
  return out_pD[:n_tokens, :d_model]


SEGMENT_ROWS = 128  # output rows per program (16 tiles of 8 sublanes); a power-of-two rank-1 SMEM block of starts
SEGMENT_RING = 256  # row copies in flight ahead of the sums (a single row copy is latency-bound)
PAIR_WINDOW = 1024  # pairs per SMEM window step of token ids and coefficients
SEGMENT_CHUNK_BYTES = 4096  # one pair's row chunk (1,024 words): the ring is 1 MiB of VMEM
PAIR_ALIGN = 128  # a 1-D HBM array is tiled by 128 elements: every window copy starts at a multiple of it


def segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
  """sums [R, D] float32 (and coef_sums [R] float32, or None): row r's sum over pairs [starts[r], starts[r+1]) of
  coefs[p] * values[tokens[p]], in pair order; each row written once by one program, no atomics."""
  n_rows = starts_R1.shape[0] - 1
  d_model = values_ND.shape[1]
  interpret = interpret_params(options)
  words, dc = word_layout(d_model, values_ND.dtype.itemsize, 1, SEGMENT_CHUNK_BYTES)
  values_NW, per_word = as_words(values_ND, words)
  ring, step = SEGMENT_RING, PAIR_WINDOW
  window = step + ring + PAIR_ALIGN
  n_pairs = max(-(-tokens_P.shape[0] // PAIR_ALIGN) * PAIR_ALIGN, window)  # whole tiles; a window always fits
  tokens_P = jnp.pad(tokens_P.astype(jnp.int32), (0, n_pairs - tokens_P.shape[0]))
  coefs_P = jnp.pad(coefs_P.astype(jnp.float32), (0, n_pairs - coefs_P.shape[0]))
  n_tiles = -(-n_rows // SEGMENT_ROWS)
  starts = starts_R1.astype(jnp.int32)
  pad = (0, n_tiles * SEGMENT_ROWS - n_rows)
  lo, hi = (jnp.pad(s, pad, constant_values=starts[-1]) for s in (starts[:-1], starts[1:]))  # padding rows: empty

  def kernel(lo_ref, hi_ref, values_hbm, tokens_hbm, coefs_hbm, *refs):
    sums_refs = refs[:per_word]
    coef_sums_ref = refs[per_word] if with_coef_sums else None
    buf, tokens_w, coefs_w, row_sem, window_sem = refs[-5:]
    c = pl.program_id(1)
    first = lo_ref[0]
    n = hi_ref[SEGMENT_ROWS - 1] - first  # the tile's pairs: [first, first + n)

    def base(j):  # window j holds pairs [base, base + window) from the tile boundary at or before first + j * step
      aligned = (first + j * step) // PAIR_ALIGN * PAIR_ALIGN
      return pl.multiple_of(jnp.minimum(aligned, n_pairs - window), PAIR_ALIGN)

    def window_copies(j):
      at = pl.ds(base(j), window)
      return [
        pltpu.make_async_copy(tokens_hbm.at[at], tokens_w.at[j % 2], window_sem.at[j % 2]),
        pltpu.make_async_copy(coefs_hbm.at[at], coefs_w.at[j % 2], window_sem.at[j % 2]),
      ]

    def row_copy(q, j):  # pair q's row chunk into ring slot q % ring; its token id read from window j
      token = tokens_w[j % 2, first + q - base(j)]
      src = values_hbm.at[pl.ds(token, 1), pl.ds(pl.multiple_of(c * dc, dc), dc)]
      return pltpu.make_async_copy(src, buf.at[q % ring], row_sem.at[q % ring])

    def wait_row(q):
      src = values_hbm.at[pl.ds(0, 1), pl.ds(0, dc)]
      pltpu.make_async_copy(src, buf.at[q % ring], row_sem.at[q % ring]).wait()

    @pl.when(n > 0)
    def _():
      for copy in window_copies(0):
        copy.start()
      for copy in window_copies(0):
        copy.wait()

    @pl.when(n > step)
    def _():
      for copy in window_copies(1):
        copy.start()

    @pl.loop(0, jnp.minimum(n, ring))
    def _(q):
      row_copy(q, 0).start()

    def pair(q, carry):
      sums, coef_sum = carry
      j = q // step

      @pl.when(jnp.logical_and(q % step == 0, q > 0))
      def _():
        for copy in window_copies(j):
          copy.wait()

        @pl.when((j + 1) * step < n)
        def _():
          for copy in window_copies(j + 1):
            copy.start()

      wait_row(q)
      coef = coefs_w[j % 2, first + q - base(j)]
      sums = tuple(total + column * coef for total, column in zip(sums, columns(buf[q % ring], per_word)))

      @pl.when(q + ring < n)
      def _():
        row_copy(q + ring, j).start()  # into the slot just read

      return sums, coef_sum + coef

    sublane = jax.lax.broadcasted_iota(jnp.int32, (8, dc), 0)

    @pl.loop(0, SEGMENT_ROWS // 8)
    def _(g):
      tiles = [jnp.zeros((8, dc), jnp.float32)] * per_word
      for i in range(8):
        r = g * 8 + i
        zero = ((jnp.zeros((1, dc), jnp.float32),) * per_word, jnp.float32(0))
        sums, coef_sum = jax.lax.fori_loop(lo_ref[r] - first, hi_ref[r] - first, pair, zero)
        tiles = [jnp.where(sublane == i, total, tile) for total, tile in zip(sums, tiles)]
        if with_coef_sums:
          coef_sums_ref[r] = coef_sum
      for sums_ref, tile in zip(sums_refs, tiles):
        sums_ref[pl.ds(pl.multiple_of(g * 8, 8), 8), :] = tile

  starts_spec = pl.BlockSpec((SEGMENT_ROWS,), lambda i, c: (i,), memory_space=pltpu.SMEM)
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  out_specs = [pl.BlockSpec((SEGMENT_ROWS, dc), lambda i, c: (i, c))] * per_word
  out_shape = [jax.ShapeDtypeStruct((n_rows, words), jnp.float32)] * per_word
  if with_coef_sums:
    out_specs.append(pl.BlockSpec((SEGMENT_ROWS,), lambda i, c: (i,), memory_space=pltpu.SMEM))
    out_shape.append(jax.ShapeDtypeStruct((n_tiles * SEGMENT_ROWS,), jnp.float32))
  outs = pl.pallas_call(
    kernel,
    grid=(n_tiles, words // dc),
    in_specs=[starts_spec, starts_spec, hbm, hbm, hbm],
    out_specs=out_specs,
    out_shape=out_shape,
    scratch_shapes=[
      pltpu.VMEM((ring, 1, dc), values_NW.dtype),
      pltpu.SMEM((2, window), jnp.int32),
      pltpu.SMEM((2, window), jnp.float32),
      pltpu.SemaphoreType.DMA((ring,)),
      pltpu.SemaphoreType.DMA((2,)),
    ],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
    name="segment_sums",
  )(lo, hi, values_NW, tokens_P, coefs_P)
  sums = outs[0] if per_word == 1 else jnp.stack(outs[:2], axis=-1).reshape(n_rows, 2 * words)
  return sums[:, :d_model], (outs[per_word][:n_rows] if with_coef_sums else None)


def fused_fits(n_slots, d_model, itemsize, interpret=False) -> bool:
  """Whether a whole row of ROW_BLOCK x n_slots rows of one table fits a slot: the fused forward needs every
  column of a token's dots before its gating, so it takes whole rows (no d chunks)."""
  words, dc = word_layout(d_model, itemsize, ROW_BLOCK * n_slots, slot_bytes(interpret))
  return dc == words


def fused_gating(gating) -> bool:
  """Whether the fused kernel lowers this gating: Pallas TPU lowers no erf (exact GELU; FFF's default form)."""
  jaxpr = str(jax.make_jaxpr(gating.value)(jnp.float32(1), jnp.float32(1)))  # nested jaxprs printed too
  return re.search(r"\berf(c|_inv)?\b", jaxpr) is None


def fused_forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  """y [N, D] (x's dtype) and h [N, S] float32 in one kernel: per step of ROW_BLOCK tokens both tables' rows land in
  VMEM by DMA (double-buffered across steps, as row_dots' rows), and per token the dots with w_in's rows (+ bias),
  the gating (reference.Gating, rounded to x's dtype) and the sum of a * w_out's rows follow without leaving the
  core. Rows are whole (fused_fits); h is written lane-dense per 128-token group, as row_dots writes its dots."""
  n_tokens, d_model = x_ND.shape
  n_slots = rows_NS.shape[1]
  dtype = x_ND.dtype
  interpret = interpret_params(options)
  if not fused_fits(n_slots, d_model, w_in_RD.dtype.itemsize, interpret):
    raise NotImplementedError(f"a block of {ROW_BLOCK} x {n_slots} whole rows of {d_model} exceeds a VMEM slot")
  w_in_RW, per_word, words, dc, steps = row_layout(n_tokens, d_model, n_slots, w_in_RD, interpret)
  w_out_RW, _ = as_words(w_out_RD, words)
  x_parts = [jnp.pad(part, [(0, steps.n_padded - n_tokens), (0, 0)]) for part in split_columns(x_ND, per_word, words)]
  rows_pS = jnp.pad(rows_NS.astype(jnp.int32), [(0, steps.n_padded - n_tokens), (0, 0)])
  bias_NS = jnp.zeros(rows_NS.shape, jnp.float32) if bias_R is None else bias_R[rows_NS].astype(jnp.float32)
  gates_Sp, bias_Sp = (
    jnp.pad(a.T.astype(jnp.float32), [(0, 0), (0, steps.n_padded - n_tokens)]) for a in (gates_NS, bias_NS)
  )
  per_group = TOKEN_GROUP // ROW_BLOCK

  def kernel(this_rows, next_rows, *refs):
    x_refs, refs = refs[:per_word], refs[per_word:]
    gates_ref, bias_ref, w_in_hbm, w_out_hbm = refs[:4]
    y_refs, h_ref = refs[4 : 4 + per_word], refs[4 + per_word]
    in_buf, out_buf, in_sem, out_sem = refs[-4:]
    q, slot = double_buffered_rows(steps, n_tokens, n_slots, dc, w_in_hbm, this_rows, next_rows, in_buf, in_sem)
    double_buffered_rows(steps, n_tokens, n_slots, dc, w_out_hbm, this_rows, next_rows, out_buf, out_sem)
    b = steps.block(q)

    @pl.when(b % per_group == 0)
    def _():
      h_ref[...] = jnp.zeros(h_ref.shape, jnp.float32)

    @pl.when(b * ROW_BLOCK < n_tokens)
    def _():
      lane = jax.lax.broadcasted_iota(jnp.int32, (n_slots, TOKEN_GROUP), 1)
      sublane = jax.lax.broadcasted_iota(jnp.int32, (ROW_BLOCK, dc), 0)
      first = (b % per_group) * ROW_BLOCK
      x_bW = [ref[...].astype(jnp.float32) for ref in x_refs]
      gates_SG, bias_SG = gates_ref[...], bias_ref[...]

      def column(a_SG, t):  # token t's column of a [S, 128] group block, exactly
        return jnp.sum(jnp.where(lane == first + t, a_SG, 0.0), axis=1, keepdims=True)

      def token(t, carry):
        h_SG, ys = carry
        h_S1 = _token_dots(column(bias_SG, t), x_bW, in_buf[slot, t], per_word, dtype, sublane, t)
        a_S1 = gating.value(h_S1, column(gates_SG, t)).astype(dtype).astype(jnp.float32)
        ys = _token_sum(ys, a_S1, out_buf[slot, t], per_word, dtype, sublane, t)
        return h_SG + jnp.where(lane == first + t, h_S1, 0.0), ys

      zeros = (jnp.zeros((ROW_BLOCK, dc), jnp.float32),) * per_word
      h_SG, ys = jax.lax.fori_loop(0, ROW_BLOCK, token, (h_ref[...], zeros))
      h_ref[...] = h_SG
      for y_ref, y in zip(y_refs, ys):
        y_ref[...] = y.astype(dtype)

  buffers = [pltpu.VMEM((2, ROW_BLOCK, n_slots, dc), w_in_RW.dtype)] * 2
  *parts, h_Sp = pl.pallas_call(
    kernel,
    grid=steps.grid,
    in_specs=[
      *steps.rows_specs(n_slots),
      *[steps.token_spec(dc)] * per_word,
      steps.group_spec(n_slots),
      steps.group_spec(n_slots),
      pl.BlockSpec(memory_space=pl.ANY),
      pl.BlockSpec(memory_space=pl.ANY),
    ],
    out_specs=[*[steps.token_spec(dc)] * per_word, steps.group_spec(n_slots)],
    out_shape=[
      *[jax.ShapeDtypeStruct((steps.n_padded, words), dtype)] * per_word,
      jax.ShapeDtypeStruct((n_slots, steps.n_padded), jnp.float32),
    ],
    scratch_shapes=[*buffers, pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))],
    compiler_params=steps.params(),
    interpret=interpret,
    name="fused_forward",
  )(rows_pS, rows_pS, *x_parts, gates_Sp, bias_Sp, w_in_RW, w_out_RW)
  y_pD = parts[0] if per_word == 1 else jnp.stack(parts, axis=-1).reshape(steps.n_padded, 2 * words)
  return y_pD[:n_tokens, :d_model], h_Sp[:, :n_tokens].T


ORDER_PAIRS = 128  # row_order_dots: pairs per grid step, one lane-dense [1, 128] block of dots
ORDER_GROUPS = ORDER_PAIRS // 8  # its row buffers: [16, 8, words], a pair's row at sublane p % 8 of group p // 8


def row_order_fits(n_tokens, d_model, itemsize, interpret=False) -> bool:
  """Whether row_order_dots' resident tokens (n_tokens rows of 32-bit words) fit half the core's VMEM."""
  words = -(-d_model * itemsize // (4 * LANES)) * LANES
  return n_tokens * words * 4 <= _vmem_capacity(interpret) // 2


def _vmem_capacity(interpret):
  """A core's VMEM in bytes (interpret mode: a v5p's 64 MiB)."""
  return 64 * 2**20 if interpret else pltpu.get_tpu_info().vmem_capacity_bytes


def row_order_dots(lhs_ND, table_RD, tokens_P, rows_P, starts_R1, options):
  """dots [P] float32 of pairs sorted by row: dots[p] = <lhs[tokens[p]], table[rows[p]]>, the table's rows rounded
  to lhs's dtype, float32 sums. A TPU has no cache to serve a row's repeats, so reuse is explicit: the tokens stay
  in VMEM (row_order_fits) and a step of ORDER_PAIRS sorted pairs copies each of its distinct rows from HBM once,
  then by local DMAs spreads each row to its pairs' slots and copies the pairs' token rows; at the ladder's ~32
  picks per row that reads a picked row about once where token order reads every pick."""
  del starts_R1  # a step reads its rows themselves
  n_tokens, d_model = lhs_ND.shape
  n_real = tokens_P.shape[0]
  interpret = interpret_params(options)
  if not row_order_fits(n_tokens, d_model, lhs_ND.dtype.itemsize, interpret):
    raise NotImplementedError(f"{n_tokens} tokens of {d_model} columns exceed half of VMEM")
  words = -(-d_model * lhs_ND.dtype.itemsize // (4 * LANES)) * LANES
  lhs_NW, per_word = as_words(lhs_ND, words)
  table_RW, _ = as_words(table_RD.astype(lhs_ND.dtype), words)  # rounded to lhs's dtype, as row_dots rounds
  n_steps = max(1, -(-n_real // ORDER_PAIRS))
  n_pairs = n_steps * ORDER_PAIRS
  tokens_P, rows_P = (jnp.pad(a.astype(jnp.int32), (0, n_pairs - n_real)) for a in (tokens_P, rows_P))
  # A pair's run: the index, within its step, of the first pair on its row (the row's one copy from HBM); a step's
  # first pair starts one, as the running max starts at 0 in every step.
  p_P = jnp.arange(n_pairs, dtype=jnp.int32)
  new_run_P = jnp.where(rows_P != jnp.roll(rows_P, 1), p_P % ORDER_PAIRS, 0)
  run_P = jax.lax.cummax(new_run_P.reshape(n_steps, ORDER_PAIRS), axis=1).reshape(-1)

  def kernel(tokens_ref, rows_ref, run_ref, lhs_vmem, table_hbm, dots_ref, tok_buf, row_buf, tab_buf, sems):
    def at(buf, p):  # pair p's row of a [16, 8, words] buffer
      return buf.at[p // 8, pl.ds(p % 8, 1)]

    def copies(p):
      token = pltpu.make_async_copy(lhs_vmem.at[pl.ds(tokens_ref[p], 1)], at(tok_buf, p), sems.at[0])
      row = pltpu.make_async_copy(table_hbm.at[pl.ds(rows_ref[p], 1)], at(row_buf, p), sems.at[1])
      return token, row

    @pl.loop(0, ORDER_PAIRS)
    def _(p):
      token, row = copies(p)
      token.start()

      @pl.when(run_ref[p] == p)
      def _():
        row.start()

    @pl.loop(0, ORDER_PAIRS)
    def _(p):
      token, row = copies(p)
      token.wait()

      @pl.when(run_ref[p] == p)
      def _():
        row.wait()

    def spread(p):  # the run's row to its pair p
      return pltpu.make_async_copy(at(row_buf, run_ref[p]), at(tab_buf, p), sems.at[2])

    @pl.loop(0, ORDER_PAIRS)
    def _(p):
      spread(p).start()

    @pl.loop(0, ORDER_PAIRS)
    def _(p):
      spread(p).wait()

    products = None
    for lhs, row in zip(columns(tok_buf[...], per_word), columns(tab_buf[...], per_word)):
      part = lhs * row
      products = part if products is None else products + part
    products_PW = products.reshape(ORDER_PAIRS, words)
    dots_ref[...] = jnp.sum(products_PW.T, axis=0, keepdims=True)[None]

  pair_block = pl.BlockSpec((ORDER_PAIRS,), lambda i: (i,), memory_space=pltpu.SMEM)
  buffer = pltpu.VMEM((ORDER_GROUPS, 8, words), lhs_NW.dtype)
  lhs_bytes = n_tokens * words * 4
  dots = pl.pallas_call(
    kernel,
    grid=(n_steps,),
    in_specs=[
      pair_block,
      pair_block,
      pair_block,
      pl.BlockSpec(memory_space=pltpu.VMEM),
      pl.BlockSpec(memory_space=pl.ANY),
    ],
    out_specs=pl.BlockSpec((1, 1, ORDER_PAIRS), lambda i: (i, 0, 0)),
    out_shape=jax.ShapeDtypeStruct((n_steps, 1, ORDER_PAIRS), jnp.float32),
    scratch_shapes=[buffer, buffer, buffer, pltpu.SemaphoreType.DMA((3,))],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel",), vmem_limit_bytes=lhs_bytes + 8 * ORDER_PAIRS * words * 4 + 16 * 2**20
    ),
    interpret=interpret,
    name="row_order_dots",
  )(tokens_P, rows_P, run_P, lhs_NW, table_RW)
  return dots.reshape(-1)[:n_real]
