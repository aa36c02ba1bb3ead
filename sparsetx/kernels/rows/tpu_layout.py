"""The layout the Pallas TPU row kernels share (pallas_tpu.py): rows as 32-bit words in whole 128-lane tiles, the
token steps of the row kernels' grid and their double-buffered row DMAs, and the VMEM budget of a step.

More: docs/modules.md, sparsetx/kernels/rows/tpu.py.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparsetx.kernels import device


def interpret_params(options):
  return pltpu.InterpretParams() if device.interpret_off("tpu", options) else False


ROW_BLOCK = 8  # tokens per step of the row kernels: the sublane tile of their [tokens, D] blocks
TOKEN_GROUP = 128  # tokens of one lane-dense [S, 128] block of row_dots' output / row_accumulate's coefficients
LANES = 128  # a d-chunk is a multiple of the 128 lanes (or a whole row)


INTERPRET_SLOT_BYTES = 2 * 1024 * 1024  # interpret mode (tests shrink it to take the chunked paths)


def slot_bytes(interpret):
  """VMEM for one step's gathered rows (one of two slots), by generation: 1/32 of the core's VMEM (4 MiB of v5e's
  and v6e's 128 MiB, 2 MiB of v5p's 64 MiB), so both slots and the token blocks fit the scoped default."""
  return INTERPRET_SLOT_BYTES if interpret else pltpu.get_tpu_info().vmem_capacity_bytes // 32


def cores(interpret):
  """TensorCores per chip (the leading parallel grid axis): 2 off TPU, to exercise the split in interpret mode."""
  return 2 if interpret else device.target().num_cores or 1


def as_words(a_ND, width: int):
  """[N, width] 32-bit words of a [N, D] array, and the columns each word holds: a 32-bit array as is (1), a
  16-bit one as pairs of columns in uint32 words (2; column 2w in the low half of word w), zero-padded to `width`
  words. One row DMA'd into VMEM fills a row of 32-bit sublanes; a lone 16-bit row would fill half of a packed
  sublane pair, a slice Mosaic refuses (its tile is 16 rows of bf16). The pairing is elementwise, so XLA can fuse
  it into the per-call cast of the float32 tables to bf16 (gated_gather.py); the words are a table-sized temporary
  per kernel call unless XLA shares them (the analytic memory model omits them: tests/test_compile.py)."""
  n, d = a_ND.shape
  per_word = 4 // a_ND.dtype.itemsize
  if per_word not in (1, 2):
    raise ValueError(f"Pallas TPU row kernels take 32- or 16-bit arrays, not {a_ND.dtype}.")
  a_ND = jnp.pad(a_ND, [(0, 0), (0, width * per_word - d)])
  if per_word == 1:
    return a_ND, 1
  return jax.lax.bitcast_convert_type(a_ND.reshape(n, width, 2), jnp.uint32), 2


def columns(words, per_word):
  """The float32 values of a block of words: [all columns] (32-bit) or [even columns, odd columns] (16-bit: a
  bf16 is the high half of the float32 it rounds from, so the shifted and masked words are exact)."""
  if per_word == 1:
    return [words.astype(jnp.float32)]
  even = pltpu.bitcast(jax.lax.shift_left(words, jnp.uint32(16)), jnp.float32)
  odd = pltpu.bitcast(jax.lax.bitwise_and(words, jnp.uint32(0xFFFF0000)), jnp.float32)
  return [even, odd]


def split_columns(a_ND, per_word, width):
  """[N, D] -> per_word arrays [N, width]: the columns the words' halves hold (all of them when per_word is 1)."""
  n, d = a_ND.shape
  a_ND = jnp.pad(a_ND, [(0, 0), (0, width * per_word - d)])
  return [a_ND] if per_word == 1 else [a_ND[:, i::2] for i in range(2)]


def word_layout(d_model, itemsize, n_rows, budget):
  """(words per row, d-chunk in words): a row is whole 128-lane tiles of 32-bit words (zero-padded: Mosaic slices
  and copies a row of VMEM only at tile boundaries), and the chunk is the whole row when n_rows rows of it fit
  `budget` bytes, else the largest multiple of 128 lanes that divides the row and fits."""
  words = -(-d_model * itemsize // (4 * LANES)) * LANES
  fits = [c for c in range(LANES, words + 1, LANES) if words % c == 0 and n_rows * c * 4 <= budget]
  return words, fits[-1] if fits else LANES


class Steps:
  """The row kernels' grid: (cores, steps per core), step q = core * per_core + j visits token block q // n_dc
  and d chunk q % n_dc. Tokens are padded to whole token groups per core, so no group spans two cores."""

  def __init__(self, n_tokens, words, dc, cores):
    per_core_tokens = -(-n_tokens // (TOKEN_GROUP * cores)) * TOKEN_GROUP
    self.n_padded = per_core_tokens * cores
    self.n_dc = words // dc
    self.per_core = per_core_tokens // ROW_BLOCK * self.n_dc
    self.total = self.per_core * cores
    self.grid = (cores, self.per_core)

  def block(self, q):
    return q // self.n_dc

  def chunk(self, q):
    return q % self.n_dc

  def rows_specs(self, n_slots):
    """SMEM blocks of the [N, S] row ids: this step's and the next step's (clamped at the last step)."""
    this = lambda i, j: (self.block(i * self.per_core + j), 0)  # noqa: E731
    after = lambda i, j: (self.block(jnp.minimum(i * self.per_core + j + 1, self.total - 1)), 0)  # noqa: E731
    return [pl.BlockSpec((ROW_BLOCK, n_slots), m, memory_space=pltpu.SMEM) for m in (this, after)]

  def group_spec(self, n_slots):
    """[S, 128] blocks over tokens, one per token group (resident over the group's steps)."""
    per_group = TOKEN_GROUP // ROW_BLOCK
    return pl.BlockSpec((n_slots, TOKEN_GROUP), lambda i, j: (0, self.block(i * self.per_core + j) // per_group))

  def token_spec(self, dc):
    q = lambda i, j: i * self.per_core + j  # noqa: E731
    return pl.BlockSpec((ROW_BLOCK, dc), lambda i, j: (self.block(q(i, j)), self.chunk(q(i, j))))

  def params(self):
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def double_buffered_rows(steps, n_tokens, n_slots, dc, table_hbm, this_rows, next_rows, buf, sem):
  """Makes step j's rows land in buf[j % 2]: step 0 starts its own, every step starts the next step's copies
  into the other slot, then waits for its own. Returns (q, slot): the global step and the slot to read."""
  core, j = pl.program_id(0), pl.program_id(1)
  q = core * steps.per_core + j
  slot = j % 2

  def each_row(step, rows_smem, fn):
    b, c = steps.block(step), steps.chunk(step)
    n_real = jnp.clip(n_tokens - b * ROW_BLOCK, 0, ROW_BLOCK)  # padding tokens: no copies (results dropped)

    @pl.loop(0, n_real * n_slots)
    def _(k):
      fn(k // n_slots, k % n_slots, c, rows_smem)

  def start(slot_):
    def fn(t, s, c, rows_smem):
      src = table_hbm.at[pl.ds(rows_smem[t, s], 1), pl.ds(pl.multiple_of(c * dc, dc), dc)]
      pltpu.make_async_copy(src, buf.at[slot_, t, pl.ds(s, 1)], sem.at[slot_]).start()

    return fn

  def wait(t, s, c, rows_smem):
    del rows_smem  # a wait counts bytes on the slot's semaphore; the source row does not matter
    src = table_hbm.at[pl.ds(0, 1), pl.ds(0, dc)]
    pltpu.make_async_copy(src, buf.at[slot, t, pl.ds(s, 1)], sem.at[slot]).wait()

  @pl.when(j == 0)
  def _():
    each_row(q, this_rows, start(slot))

  @pl.when(j + 1 < steps.per_core)
  def _():
    each_row(q + 1, next_rows, start(1 - slot))

  each_row(q, this_rows, wait)
  return q, slot


def row_layout(n_tokens, d_model, n_slots, table_RD, interpret):
  words, dc = word_layout(d_model, table_RD.dtype.itemsize, ROW_BLOCK * n_slots, slot_bytes(interpret))
  table_RW, per_word = as_words(table_RD, words)
  return table_RW, per_word, words, dc, Steps(n_tokens, words, dc, cores(interpret))
