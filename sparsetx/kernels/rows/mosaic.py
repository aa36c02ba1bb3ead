"""Mosaic GPU row kernels of the sparse layers (Hopper and newer: H100, H200, B200), composed in row_gather.py:
the gated gather's forward and backward, FFF's walk levels, the d-split's partial dots and the table gradients.

Three kernels do all the row work; the per-slot arithmetic between them is elementwise on [N, S] and stays
in XLA: N * S floats, about 1 MB at 2,048 tokens and S = 128, against ~800 MB of gathered rows.

More: docs/modules.md, sparsetx/kernels/rows/mosaic.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

# The race verdict of Mosaic GPU's interpret mode is not exported publicly (jax 0.11, 0.12).
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparsetx.kernels import device
from sparsetx.kernels.rows import mosaic_tiling

BLOCK_TOKENS = 64  # rows of a WGMMA-layout register tile: one warpgroup's token block
BLOCK_ROWS = 64  # segment_sums: table rows per program, and pairs per gathered tile
WARPGROUP = 128  # threads
TILE = plgpu.Layout.WGMMA  # [64, block_d] float32 tile
PER_TOKEN = plgpu.Layout.WGMMA.reduce(1)  # [64] vector, one value per token row of a tile


class _Lanes:
  """Register-layout directives, applied only when compiling for a GPU (interpret mode has no layouts)."""

  def __init__(self, interpret):
    self.interpret = interpret

  def load(self, ref, layout):
    return ref[...] if self.interpret else plgpu.load(ref, layout=layout, optimized=False)

  def cast(self, array, layout):
    return array if self.interpret else plgpu.layout_cast(array, layout)


def _pad_tokens(*arrays_SN):
  """The [S, N] operands with N padded to whole token blocks (padding tokens read row 0 with coefficient 0)."""
  n_tokens = arrays_SN[0].shape[1]
  pad = -n_tokens % BLOCK_TOKENS
  return [jnp.pad(a, ((0, 0), (0, pad))) for a in arrays_SN]


def _slot_slabs(n_slots):
  """[start, size) ranges of at most 256 slots: a TMA box spans at most 256 elements per dimension."""
  return [(start, min(256, n_slots - start)) for start in range(0, n_slots, 256)]


def _copy_token_block(src_SN_gmem, dst_SB_smem, t0, barrier):
  """Starts the copies of the block's columns [S, 64] of a per-slot array (one arrival per 256-slot slab)."""
  for start, size in _slot_slabs(dst_SB_smem.shape[0]):
    slab = src_SN_gmem.at[pl.ds(start, size), pl.ds(t0, BLOCK_TOKENS)]
    plgpu.copy_gmem_to_smem(slab, dst_SB_smem.at[pl.ds(start, size)], barrier)


def _tiling(kernel, scratch_of, d_model, itemsize, options, reduces, multiple=1) -> mosaic_tiling.Tiling:
  """The kernel's tiling for the target device's shared memory per block (JAX's default where it is unknown)."""
  smem = device.target().shared_memory_per_block or mosaic_tiling.DEFAULT_SMEM_PER_BLOCK
  return mosaic_tiling.choose(kernel, scratch_of, d_model, itemsize, options, smem, reduces, multiple)


def _interpret_params(options):
  if device.interpret_off("gpu", options):
    return plgpu.InterpretGPUParams(detect_races=True)  # tests read the verdict (kernel_cases.mosaic_races_found)
  return None


def _gather_tile(table_gmem, rows_of, c, block_d, tile_smem, barrier):
  """Starts the 64 one-row copies that fill tile_smem [64, block_d] with chunk c of rows_of(j), j < 64."""

  @pl.loop(0, BLOCK_TOKENS)
  def _(j):
    row = table_gmem.at[pl.ds(rows_of(j), 1), pl.ds(c * block_d, block_d)]
    plgpu.copy_gmem_to_smem(row, tile_smem.at[pl.ds(j, 1)], barrier)


class _Ring:
  """`stages` tile slots between the copy warpgroup, which fills step q into slot q % stages once the compute
  warpgroup has taken step q - stages out of it, and the compute warpgroup, which takes the steps in order."""

  def __init__(self, stages, loaded, consumed, lanes):
    self.stages, self.loaded, self.consumed, self.lanes = stages, loaded, consumed, lanes

  def fill_all(self, n_steps, fill):
    """Copy warpgroup: fill(q, slot, barrier) for every step, each after its slot is free."""

    @pl.loop(0, n_steps)
    def _(q):
      slot = lax.rem(q, self.stages)

      @pl.when(q >= self.stages)
      def _():
        plgpu.barrier_wait(self.consumed.at[slot])

      fill(q, slot, self.loaded.at[slot])

    first_unseen = max(0, n_steps - self.stages) if isinstance(n_steps, int) else jnp.maximum(n_steps - self.stages, 0)

    @pl.loop(first_unseen, n_steps)  # drain: see every slot taken (no phase left unobserved)
    def _(q):
      plgpu.barrier_wait(self.consumed.at[lax.rem(q, self.stages)])

  def take(self, q, tiles_smem, dtype):
    """Compute warpgroup: step q's tile in float32 registers (rounded to dtype first); its slot is freed."""
    slot = lax.rem(q, self.stages)
    plgpu.barrier_wait(self.loaded.at[slot])
    tile = self.lanes.load(tiles_smem.at[slot], TILE)
    release(self.consumed.at[slot])
    return tile.astype(dtype).astype(jnp.float32)


def release(consumed_barrier):
  """Frees a ring slot the compute warpgroup has read with ordinary loads: a proxy fence (commit_smem) orders
  those generic-proxy reads before the copy warpgroup's next TMA write into the slot (an async-proxy write), then
  the arrival. Without it the read and the overwrite race (jax 0.12's interpreter reports it)."""
  plgpu.commit_smem()
  plgpu.barrier_arrive(consumed_barrier)


def _ring_barriers(stages):
  return [
    plgpu.Barrier(num_arrivals=BLOCK_TOKENS, num_barriers=stages),  # loaded: one arrival per row copy
    plgpu.Barrier(num_barriers=stages),  # consumed: the compute warpgroup's arrival
  ]


def _specialized_kernel(body, out_type, grid, scratch_types, interpret):
  """Two warpgroups per program (grid: {axis name: size}): 0 computes, 1 issues the copies (body(wg, *refs)
  branches on wg)."""
  return plgpu.kernel(
    lambda *refs: body(lax.axis_index("wg"), *refs),
    out_type=out_type,
    grid=tuple(grid.values()),
    grid_names=tuple(grid),
    num_threads=2,
    thread_name="wg",
    scratch_types=scratch_types,
    interpret=interpret,
  )


def row_dots_scratch(n_slots, dtype, table_dtype, block_d, stages) -> list:
  """row_dots' shared memory: the lhs and table tile rings, the block's rows and dots, the ring's barriers."""
  return [
    plgpu.SMEM((stages, BLOCK_TOKENS, block_d), dtype),
    plgpu.SMEM((stages, BLOCK_TOKENS, block_d), table_dtype),
    plgpu.SMEM((n_slots, BLOCK_TOKENS), jnp.int32),
    plgpu.SMEM((n_slots, BLOCK_TOKENS), jnp.float32),
    *_ring_barriers(stages),
    plgpu.Barrier(num_arrivals=len(_slot_slabs(n_slots))),
  ]


def row_dots(lhs_ND, table_RD, rows_SN, options):
  """dots [S, N] float32: <lhs[t], table[rows[s, t]]>, both operands rounded to lhs's dtype, summed in float32."""
  n_real = lhs_ND.shape[0]
  (rows_SN,) = _pad_tokens(rows_SN)
  lhs_ND = jnp.pad(lhs_ND, ((0, rows_SN.shape[1] - n_real), (0, 0)))
  n_tokens, d_model = lhs_ND.shape
  n_slots = rows_SN.shape[0]
  dtype = lhs_ND.dtype
  scratch_of = functools.partial(row_dots_scratch, n_slots, dtype, table_RD.dtype)
  itemsize = min(dtype.itemsize, table_RD.dtype.itemsize)
  block_d, stages, _ = _tiling("row_dots", scratch_of, d_model, itemsize, options, reduces=True)
  interpret = _interpret_params(options)
  lanes = _Lanes(interpret is not None)
  n_chunks = d_model // block_d
  steps_per_chunk = n_slots + 1  # the block's own lhs chunk, then one gathered tile per slot

  def body(wg, lhs_gmem, table_gmem, rows_gmem, dots_gmem, lhs_ring, table_ring, rows_smem, dots_smem, *barriers):
    loaded, consumed, rows_loaded = barriers
    ring = _Ring(stages, loaded, consumed, lanes)
    t0 = lax.axis_index("tokens") * BLOCK_TOKENS

    @pl.when(wg == 1)
    def _copy():
      _copy_token_block(rows_gmem, rows_smem, t0, rows_loaded)
      plgpu.barrier_wait(rows_loaded)

      def fill(q, slot, barrier):
        c, r = lax.div(q, steps_per_chunk), lax.rem(q, steps_per_chunk)

        @pl.when(r == 0)
        def _():
          _gather_tile(lhs_gmem, lambda j: t0 + j, c, block_d, lhs_ring.at[slot], barrier)

        @pl.when(r > 0)
        def _():
          _gather_tile(table_gmem, lambda j: rows_smem[r - 1, j], c, block_d, table_ring.at[slot], barrier)

      ring.fill_all(n_chunks * steps_per_chunk, fill)

    @pl.when(wg == 0)
    def _compute():
      @pl.loop(0, n_chunks)
      def _(c):
        lhs_tile = ring.take(c * steps_per_chunk, lhs_ring, dtype)

        @pl.loop(0, n_slots)
        def _(s):
          partial = jnp.sum(lhs_tile * ring.take(c * steps_per_chunk + 1 + s, table_ring, dtype), axis=1)

          # Branches, not a select on the scalar c: Warpgroup semantics refuse a select whose condition's shape
          # is not its operands' (an implicit broadcast).
          @pl.when(c == 0)
          def _():
            dots_smem[s] = partial

          @pl.when(c > 0)
          def _():
            dots_smem[s] = lanes.load(dots_smem.at[s], PER_TOKEN) + partial

      plgpu.commit_smem()
      for start, size in _slot_slabs(n_slots):
        out = dots_gmem.at[pl.ds(start, size), pl.ds(t0, BLOCK_TOKENS)]
        plgpu.copy_smem_to_gmem(dots_smem.at[pl.ds(start, size)], out)
      plgpu.wait_smem_to_gmem(0)

  kernel = _specialized_kernel(
    body,
    jax.ShapeDtypeStruct((n_slots, n_tokens), jnp.float32),
    {"tokens": n_tokens // BLOCK_TOKENS},
    scratch_of(block_d, stages),
    interpret,
  )
  return kernel(lhs_ND, table_RD, rows_SN)[:, :n_real]


def row_accumulate_scratch(n_slots, out_dtype, table_dtype, block_d, stages) -> list:
  """row_accumulate's shared memory: the table tile ring, the block's rows and coefficients, its output tile."""
  return [
    plgpu.SMEM((stages, BLOCK_TOKENS, block_d), table_dtype),
    plgpu.SMEM((n_slots, BLOCK_TOKENS), jnp.int32),
    plgpu.SMEM((n_slots, BLOCK_TOKENS), jnp.float32),
    plgpu.SMEM((BLOCK_TOKENS, block_d), out_dtype),
    *_ring_barriers(stages),
    plgpu.Barrier(num_arrivals=2 * len(_slot_slabs(n_slots))),
  ]


def row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, options):
  """out [N, D] in out_dtype: sum_s coef[s, t] * table[rows[s, t]] (rows rounded to out_dtype, float32 sums)."""
  n_real = coef_SN.shape[1]
  coef_SN, rows_SN = _pad_tokens(coef_SN, rows_SN)
  n_slots, n_tokens = coef_SN.shape
  d_model = table_RD.shape[1]
  out_dtype = jnp.dtype(out_dtype)
  scratch_of = functools.partial(row_accumulate_scratch, n_slots, out_dtype, table_RD.dtype)
  itemsize = min(out_dtype.itemsize, table_RD.dtype.itemsize)
  block_d, stages, _ = _tiling("row_accumulate", scratch_of, d_model, itemsize, options, reduces=False)
  interpret = _interpret_params(options)
  lanes = _Lanes(interpret is not None)
  n_chunks = d_model // block_d

  def body(wg, coef_gmem, table_gmem, rows_gmem, out_gmem, tiles, rows_smem, coef_smem, out_smem, *barriers):
    loaded, consumed, block_loaded = barriers
    ring = _Ring(stages, loaded, consumed, lanes)
    t0 = lax.axis_index("tokens") * BLOCK_TOKENS

    @pl.when(wg == 1)
    def _copy():
      _copy_token_block(rows_gmem, rows_smem, t0, block_loaded)
      _copy_token_block(coef_gmem, coef_smem, t0, block_loaded)
      plgpu.barrier_wait(block_loaded)

      def fill(q, slot, barrier):
        c, s = lax.div(q, n_slots), lax.rem(q, n_slots)
        _gather_tile(table_gmem, lambda j: rows_smem[s, j], c, block_d, tiles.at[slot], barrier)

      ring.fill_all(n_chunks * n_slots, fill)

    @pl.when(wg == 0)
    def _compute():
      plgpu.barrier_wait(block_loaded)

      @pl.loop(0, n_chunks)
      def _(c):
        def add_slot(s, acc):
          tile = ring.take(c * n_slots + s, tiles, out_dtype)
          coef = lanes.load(coef_smem.at[s], PER_TOKEN)
          return acc + lax.broadcast_in_dim(coef, tile.shape, [0]) * tile

        acc = lax.fori_loop(0, n_slots, add_slot, lanes.cast(jnp.zeros((BLOCK_TOKENS, block_d), jnp.float32), TILE))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk has left out_smem
        out_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(t0, BLOCK_TOKENS), pl.ds(c * block_d, block_d)])

      plgpu.wait_smem_to_gmem(0)

  kernel = _specialized_kernel(
    body,
    jax.ShapeDtypeStruct((n_tokens, d_model), out_dtype),
    {"tokens": n_tokens // BLOCK_TOKENS},
    scratch_of(block_d, stages),
    interpret,
  )
  return kernel(coef_SN, table_RD, rows_SN)[:n_real]


def _row_chunk_layout(block_d):
  """A [block_d] float32 vector spread over the warpgroup's 128 threads, up to 4 adjacent values per thread."""
  vec_size = 1
  while vec_size < 4 and block_d % (WARPGROUP * 2 * vec_size) == 0:
    vec_size *= 2
  return plgpu.Layout.WG_STRIDED((block_d,), vec_size=vec_size)


def segment_sums_scratch(dtype, block_d, stages) -> list:
  """segment_sums' shared memory: the value tile ring with its tokens and coefficients, the block's pair ranges,
  its sums and coefficient sums, the barriers."""
  return [
    plgpu.SMEM((stages, BLOCK_ROWS, block_d), dtype),
    plgpu.SMEM((stages, BLOCK_ROWS), jnp.int32),
    plgpu.SMEM((stages, BLOCK_ROWS), jnp.float32),
    plgpu.SMEM((BLOCK_ROWS,), jnp.int32),
    plgpu.SMEM((BLOCK_ROWS,), jnp.int32),
    plgpu.SMEM((BLOCK_ROWS, block_d), jnp.float32),
    plgpu.SMEM((BLOCK_ROWS,), jnp.float32),
    *_ring_barriers(stages),
    plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # pairs_loaded: a tile's tokens and coefficients
    plgpu.Barrier(num_arrivals=2),  # block_loaded: the block's pair ranges
  ]


def segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
  """(sums [R, D] float32, coef_sums [R] float32 or None): row r's pairs p in [starts[r], starts[r+1]) summed
  in pair order, sums[r] = sum_p coefs[p] * values[tokens[p]] and coef_sums[r] = sum_p coefs[p]."""
  d_model = values_ND.shape[1]
  n_pairs, n_rows = tokens_P.shape[0], starts_R1.shape[0] - 1
  if n_rows == 0 or n_pairs == 0:
    coef_sums = jnp.zeros((n_rows,), jnp.float32) if with_coef_sums else None
    return jnp.zeros((n_rows, d_model), jnp.float32), coef_sums
  dtype = values_ND.dtype
  interpret = _interpret_params(options)
  lanes = _Lanes(interpret is not None)
  multiple = 1 if lanes.interpret else WARPGROUP
  # A row chunk spans the warpgroup's threads, so this kernel's chunk is at least WARPGROUP values whatever the
  # gathers' block_d (their tiles' width, a separate trade-off).
  wide = options._replace(block_d=max(options.block_d, multiple))
  scratch_of = functools.partial(segment_sums_scratch, dtype)
  block_d, stages, _ = _tiling("segment_sums", scratch_of, d_model, dtype.itemsize, wide, False, multiple)
  row_chunk = _row_chunk_layout(block_d)
  n_blocks = -(-n_rows // BLOCK_ROWS)
  n_padded = n_blocks * BLOCK_ROWS

  # Row r's pair range is [bounds[0, r], bounds[1, r]); padding rows are empty ranges at starts[R], so a block's pairs
  # are [bounds[0, r0], bounds[1, r0 + 63]) and pairs past starts[R] are never read. Tokens and coefficients get one
  # tile of padding so a block's last tile copy stays in bounds. Both ranges travel as one array: a kernel operand
  # must start 256-byte aligned, and XLA passes `starts[1:]` as a pointer 4 bytes into `starts` (seen on an H200).
  starts_R1 = starts_R1.astype(jnp.int32)
  tail = jnp.full((n_padded - n_rows,), starts_R1[-1], jnp.int32)
  bounds_2R = jnp.stack([jnp.concatenate([starts_R1[:-1], tail]), jnp.concatenate([starts_R1[1:], tail])])
  tokens_pP = jnp.pad(tokens_P.astype(jnp.int32), (0, BLOCK_ROWS))
  coefs_pP = jnp.pad(coefs_P.astype(jnp.float32), (0, BLOCK_ROWS))

  def body(wg, values_gmem, tokens_gmem, coefs_gmem, bounds_gmem, *refs):
    sums_gmem, coef_sums_gmem = refs[:2] if with_coef_sums else (refs[0], None)
    tiles, tokens_ring, coefs_ring, begins_smem, ends_smem, sums_smem, coef_sums_smem, *barriers = refs[-11:]
    loaded, consumed, pairs_loaded, block_loaded = barriers
    ring = _Ring(stages, loaded, consumed, lanes)
    r0, c = lax.axis_index("rows") * BLOCK_ROWS, lax.axis_index("chunks")

    @pl.when(wg == 1)
    def _copy():
      plgpu.copy_gmem_to_smem(bounds_gmem.at[0, pl.ds(r0, BLOCK_ROWS)], begins_smem, block_loaded)
      plgpu.copy_gmem_to_smem(bounds_gmem.at[1, pl.ds(r0, BLOCK_ROWS)], ends_smem, block_loaded)
      plgpu.barrier_wait(block_loaded)
      p_begin, p_end = begins_smem[0], ends_smem[BLOCK_ROWS - 1]

      def fill(q, slot, barrier):
        p0 = p_begin + q * BLOCK_ROWS
        plgpu.copy_gmem_to_smem(tokens_gmem.at[pl.ds(p0, BLOCK_ROWS)], tokens_ring.at[slot], pairs_loaded.at[slot])
        plgpu.copy_gmem_to_smem(coefs_gmem.at[pl.ds(p0, BLOCK_ROWS)], coefs_ring.at[slot], pairs_loaded.at[slot])
        plgpu.barrier_wait(pairs_loaded.at[slot])
        token_of = lambda j: jnp.where(p0 + j < p_end, tokens_ring[slot, j], 0)  # the tile's tail: any valid row
        _gather_tile(values_gmem, token_of, c, block_d, tiles.at[slot], barrier)

      ring.fill_all(lax.div(p_end - p_begin + BLOCK_ROWS - 1, BLOCK_ROWS), fill)

    @pl.when(wg == 0)
    def _compute():
      plgpu.barrier_wait(block_loaded)
      p_begin, p_end = begins_smem[0], ends_smem[BLOCK_ROWS - 1]

      def add_pair(p, carry):
        """Adds pair p (tile (p - p_begin) // 64, row j of it) to the row's sums; waits for the tile at its first
        pair and frees its slot after its last."""
        acc, coef_sum = carry
        k, j = lax.div(p - p_begin, BLOCK_ROWS), lax.rem(p - p_begin, BLOCK_ROWS)
        slot = lax.rem(k, stages)

        @pl.when(j == 0)
        def _():
          plgpu.barrier_wait(pairs_loaded.at[slot])
          plgpu.barrier_wait(loaded.at[slot])

        value = lanes.load(tiles.at[slot, j], row_chunk).astype(jnp.float32)
        coef = coefs_ring[slot, j]

        @pl.when((j == BLOCK_ROWS - 1) | (p == p_end - 1))
        def _():
          release(consumed.at[slot])

        return acc + coef * value, coef_sum + coef

      @pl.loop(0, BLOCK_ROWS)
      def _(i):
        zero = (lanes.cast(jnp.zeros((block_d,), jnp.float32), row_chunk), jnp.float32(0))
        acc, coef_sum = lax.fori_loop(begins_smem[i], ends_smem[i], add_pair, zero)
        sums_smem[i] = acc
        if with_coef_sums:
          coef_sums_smem[i] = coef_sum

      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(sums_smem, sums_gmem.at[pl.ds(r0, BLOCK_ROWS), pl.ds(c * block_d, block_d)])
      if with_coef_sums:

        @pl.when(c == 0)
        def _():
          plgpu.copy_smem_to_gmem(coef_sums_smem, coef_sums_gmem.at[pl.ds(r0, BLOCK_ROWS)])

      plgpu.wait_smem_to_gmem(0)

  out_type = [jax.ShapeDtypeStruct((n_padded, d_model), jnp.float32)]
  if with_coef_sums:
    out_type.append(jax.ShapeDtypeStruct((n_padded,), jnp.float32))
  kernel = _specialized_kernel(
    body,
    tuple(out_type),
    {"rows": n_blocks, "chunks": d_model // block_d},
    scratch_of(block_d, stages),
    interpret,
  )
  sums, *coef_sums = kernel(values_ND, tokens_pP, coefs_pP, bounds_2R)
  return sums[:n_rows], coef_sums[0][:n_rows] if with_coef_sums else None
