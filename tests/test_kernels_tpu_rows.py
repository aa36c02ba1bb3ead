"""The Pallas TPU row kernels (row_dots, row_accumulate, segment_sums; docs/kernels.md) equal NumPy float64
references in TPU interpret mode, and lower for TPU v5p and v6e at a ladder-like shape.

Tolerances follow from the arithmetic: n float32 roundings (n - 1 additions and the product's) over terms t_i
move a sum by at most n * eps32 * sum |t_i| (eps32 = 2**-24); a result cast to bfloat16 once adds at most
eps_bf16 = 2**-8 of its magnitude. Inputs are generated in the kernels' dtypes, so the references start from
the same values (rows rounded to a narrower dtype are rounded here with ml_dtypes, as NumPy does).

Interpret mode runs the kernels' DMAs and semaphores, so these cases check the cross-step double buffering
(rows of step j + 1 landing while step j computes), padding tokens without copies, d_model chunks and the
core split; small SLOT_BYTES / SEGMENT_RING / PAIR_WINDOW make tiny shapes take the chunked, wrapping paths.
The lowering test reads the Mosaic module inside each tpu_custom_call for its grid and dimension semantics.
"""

import base64
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax._src.tpu_custom_call import tpu as tpu_dialect

from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import tpu, tpu_layout
from sparsetx.kernels.rows.reference import Gating
from sparsetx.measure import aot
from sparsetx.models.ffn.common import gelu_tanh
from sparsetx.perf import hlo_text

EPS32 = 2.0**-24
EPS_BF16 = 2.0**-8
OPTIONS = KernelOptions("tpu", interpret=True)


def as64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def assert_within(result, reference, bound, name):
  result = as64(result)
  excess = np.abs(result - reference) - bound
  assert excess.max() <= 0, (
    f"{name}: off by {excess.max()} beyond the bound at {np.unravel_index(excess.argmax(), excess.shape)}"
  )


def cast_bound(out_dtype, reference, bound):
  """A float32 result within `bound` of the reference, then cast to out_dtype once."""
  return bound + (EPS_BF16 * (np.abs(reference) + bound) if out_dtype == jnp.bfloat16 else 0.0)


# (tokens N, slots S, rows R, d_model D, lhs / output dtype, table dtype, slot bytes): N ragged, S not a power of
# two; the first case's 128-lane d chunks (3 of D = 384), the second's 260 tokens span two token groups on two cores.
ROW_CASES = [
  (13, 6, 40, 384, jnp.float32, jnp.float32, 8 * 6 * 128 * 4),
  (260, 3, 50, 64, jnp.bfloat16, jnp.float32, tpu_layout.INTERPRET_SLOT_BYTES),
  (21, 5, 30, 640, jnp.bfloat16, jnp.bfloat16, 8 * 5 * 128 * 4),  # bf16 rows as uint32 words: 3 chunks of 128 words
  (9, 4, 20, 192, jnp.float32, jnp.bfloat16, tpu_layout.INTERPRET_SLOT_BYTES),  # 96 words padded to 128
]


def row_case(seed, n_tokens, n_slots, n_rows, d_model, dtype, table_dtype):
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((n_rows, d_model)).astype(table_dtype)
  rows = rng.integers(0, n_rows, (n_slots, n_tokens)).astype(np.int32)
  rows[:, 0] = n_rows - 1  # the last row
  return rng, table, rows


@pytest.mark.parametrize("n_tokens, n_slots, n_rows, d_model, dtype, table_dtype, slot_bytes", ROW_CASES)
def test_row_dots_equals_float64_dots(monkeypatch, n_tokens, n_slots, n_rows, d_model, dtype, table_dtype, slot_bytes):
  monkeypatch.setattr(tpu_layout, "INTERPRET_SLOT_BYTES", slot_bytes)
  rng, table, rows = row_case(1, n_tokens, n_slots, n_rows, d_model, dtype, table_dtype)
  lhs = rng.standard_normal((n_tokens, d_model)).astype(dtype)
  dots = tpu.row_dots(jnp.asarray(lhs), jnp.asarray(table), jnp.asarray(rows), OPTIONS)
  assert dots.shape == (n_slots, n_tokens) and dots.dtype == jnp.float32
  terms = as64(lhs)[None] * as64(table.astype(dtype))[rows]  # [S, N, D]: rows rounded to lhs's dtype
  bound = d_model * EPS32 * np.abs(terms).sum(-1)
  assert_within(dots, terms.sum(-1), bound, "dots")


@pytest.mark.parametrize("n_tokens, n_slots, n_rows, d_model, dtype, table_dtype, slot_bytes", ROW_CASES)
def test_row_accumulate_equals_float64_sums(
  monkeypatch, n_tokens, n_slots, n_rows, d_model, dtype, table_dtype, slot_bytes
):
  monkeypatch.setattr(tpu_layout, "INTERPRET_SLOT_BYTES", slot_bytes)
  rng, table, rows = row_case(2, n_tokens, n_slots, n_rows, d_model, dtype, table_dtype)
  coef = rng.standard_normal((n_slots, n_tokens)).astype(np.float32)
  out = tpu.row_accumulate(jnp.asarray(coef), jnp.asarray(table), jnp.asarray(rows), dtype, OPTIONS)
  assert out.shape == (n_tokens, d_model) and out.dtype == dtype
  terms = as64(coef)[:, :, None] * as64(table.astype(dtype))[rows]  # [S, N, D]: rows rounded to out_dtype
  reference = terms.sum(0)
  bound = n_slots * EPS32 * np.abs(terms).sum(0)
  assert_within(out, reference, cast_bound(dtype, reference, bound), "out")


# (tokens N, rows R, d_model D, values dtype, with_coef_sums): R ragged over two 128-row tiles.
SEGMENT_CASES = [
  (11, 150, 384, jnp.float32, True),
  (7, 150, 128, jnp.bfloat16, False),
  (5, 150, 2304, jnp.bfloat16, True),
]


@pytest.mark.parametrize("n_tokens, n_rows, d_model, dtype, with_coef_sums", SEGMENT_CASES)
def test_segment_sums_equal_float64_row_sums(monkeypatch, n_tokens, n_rows, d_model, dtype, with_coef_sums):
  monkeypatch.setattr(tpu, "SEGMENT_RING", 4)  # the ring wraps and windows change within a tile
  monkeypatch.setattr(tpu, "PAIR_WINDOW", 8)
  rng = np.random.default_rng(3)
  counts = rng.integers(0, 4, n_rows)
  counts[[0, 5, 6, 7, n_rows - 1]] = 0  # empty rows, the first and the last among them
  counts[130] = 23  # a long row: several windows and ring turns
  starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  n_pairs = int(starts[-1]) + 5  # pairs past starts[R] are padding
  values = rng.standard_normal((n_tokens, d_model)).astype(dtype)
  tokens = rng.integers(0, n_tokens, n_pairs).astype(np.int32)
  coefs = rng.standard_normal(n_pairs).astype(np.float32)
  sums, coef_sums = tpu.segment_sums(
    jnp.asarray(values), jnp.asarray(tokens), jnp.asarray(coefs), jnp.asarray(starts), OPTIONS, with_coef_sums
  )
  assert sums.shape == (n_rows, d_model) and sums.dtype == jnp.float32
  row_of = np.repeat(np.arange(n_rows), counts)  # the row of each real pair
  real = slice(0, starts[-1])
  terms = as64(coefs[real])[:, None] * as64(values)[tokens[real]]
  reference, magnitude = np.zeros((n_rows, d_model)), np.zeros((n_rows, d_model))
  np.add.at(reference, row_of, terms)
  np.add.at(magnitude, row_of, np.abs(terms))
  n = counts.max() + 1
  assert_within(sums, reference, n * EPS32 * magnitude, "sums")
  assert not np.asarray(sums)[counts == 0].any()  # empty rows are exactly 0
  if with_coef_sums:
    coef_reference, coef_magnitude = np.zeros(n_rows), np.zeros(n_rows)
    np.add.at(coef_reference, row_of, as64(coefs[real]))
    np.add.at(coef_magnitude, row_of, np.abs(as64(coefs[real])))
    assert coef_sums.shape == (n_rows,)
    assert_within(coef_sums, coef_reference, n * EPS32 * coef_magnitude, "coef_sums")
  else:
    assert coef_sums is None


def test_bfloat16_rounding_of_f32_table_rows_matches_ml_dtypes():
  """The references round table rows to bf16 through ml_dtypes (NumPy's bfloat16), as XLA rounds (to nearest even)."""
  x = np.array([1 + 2**-8, 1 + 3 * 2**-9, -(1 + 2**-8 + 2**-10)], np.float32)
  np.testing.assert_array_equal(x.astype(ml_dtypes.bfloat16), np.asarray(jnp.asarray(x).astype(jnp.bfloat16)))


def mosaic_modules(lowered_text):
  """{kernel name: Mosaic MLIR text} of the tpu_custom_calls in a lowered program (their serialized bodies)."""
  modules = {}
  for line in lowered_text.splitlines():
    if "@tpu_custom_call" not in line:
      continue
    config = json.loads(re.search(r'backend_config = "(.*?)", kernel_name', line)[1].replace("\\22", '"'))
    body = base64.b64decode(config["custom_call_config"]["body"])
    context = jax_mlir.make_ir_context()
    tpu_dialect.register_dialect(context)
    context.allow_unregistered_dialects = True  # the body's ops are serialized as the versioned stable_mosaic
    with context:
      modules[re.search(r'kernel_name = "(\w+)"', line)[1]] = str(ir.Module.parse(body))
  return modules


# The ladder's layer shape: 4,096 tokens of a step, S = 128 slots, d_model = 640, 16 x 5,776 table rows.
N, S, D, R = 4096, 128, 640, 16 * 5776


TOPOLOGY = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def kernel_programs(n_tokens, n_slots, d_model, n_rows, dtype):
  """{name: (fn, *abstract args)} of the three row kernels at a shape, tables and tokens in `dtype`."""
  spec = jax.ShapeDtypeStruct
  options = KernelOptions("tpu")
  rows, table = spec((n_slots, n_tokens), jnp.int32), spec((n_rows, d_model), dtype)
  return {
    "row_dots": (lambda x, w, r: tpu.row_dots(x, w, r, options), spec((n_tokens, d_model), dtype), table, rows),
    "row_accumulate": (
      lambda c, w, r: tpu.row_accumulate(c, w, r, dtype, options),
      spec((n_slots, n_tokens), jnp.float32),
      table,
      rows,
    ),
    "segment_sums": (
      lambda v, t, c, s: tpu.segment_sums(v, t, c, s, options, with_coef_sums=True),
      spec((n_tokens, d_model), dtype),
      spec((n_tokens * n_slots,), jnp.int32),
      spec((n_tokens * n_slots,), jnp.float32),
      spec((n_rows + 1,), jnp.int32),
    ),
  }


# Every layout _word_layout makes: rows of 1 to 64 lane tiles, whole or in chunks, bf16 pairs and float32 words.
D_MODELS = (128, 384, 1152, 4224, 8192)


@pytest.mark.parametrize("chip", list(TOPOLOGY))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_row_kernels_compile_for_tpu_at_every_d_model(chip, dtype):
  """Mosaic checks a kernel only when libtpu compiles it: tile-aligned slices of VMEM (8 rows of 32 bits, 16 of
  bf16, 128 lanes), 1-D HBM windows on 128-element tiles, buffers within scoped VMEM. 1,000 tokens (not a whole
  block), sgatlin's 128 slots, each d_model of D_MODELS, on a 2-core v5p and a 1-core v6e. d_model only changes
  the row layout (_word_layout), which test_row_layouts_are_whole_lane_tiles_within_the_slot_budget checks for
  every multiple of 128 up to 8,192."""
  with aot.on_topology(TOPOLOGY[chip]):
    for d_model in D_MODELS:
      for f, *args in kernel_programs(1000, 128, d_model, 4096, dtype).values():
        jax.jit(f).trace(*args).lower().compile()  # raises on Mosaic's refusal


@pytest.mark.parametrize("chip", list(TOPOLOGY))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_fused_forward_compiles_for_tpu_where_its_whole_rows_fit(chip, dtype):
  """tpu.fused_forward holds a step's whole rows of both tables (no d chunks): it compiles at every d_model of
  D_MODELS whose rows fit the chip's slot, with a bias and tanh-GELU outside the gate, and refuses the others."""
  spec = jax.ShapeDtypeStruct
  gating = Gating(gelu_tanh, gate_inside=False)
  compiled = []
  with aot.on_topology(TOPOLOGY[chip]):
    for d_model in D_MODELS:
      table = spec((4096, d_model), dtype)
      args = (spec((1000, d_model), dtype), table, table, spec((1000, 128), jnp.int32), spec((1000, 128), jnp.float32))
      fused = lambda *a: tpu.fused_forward(*a, jnp.ones((4096,)), gating, KernelOptions("tpu"))  # noqa: E731
      if tpu.fused_fits(128, d_model, jnp.dtype(dtype).itemsize):
        jax.jit(fused).trace(*args).lower().compile()
        compiled.append(d_model)
      else:
        with pytest.raises(NotImplementedError, match="exceeds a VMEM slot"):
          jax.jit(fused).trace(*args)
  assert 384 in compiled and 8192 not in compiled, compiled


@pytest.mark.parametrize("chip", list(TOPOLOGY))
def test_the_row_order_dots_compile_for_tpu(chip):
  """tpu.row_order_dots (tokens resident in VMEM, each step's distinct rows copied from HBM once and spread
  by local DMAs, a lane-dense [1, 128] block of dots per step) compiles with libtpu: bf16 words at the ladder's
  640 columns, and 1,000 float32 tokens of 8,192 columns (31 MiB, just under half of a v5p's VMEM)."""
  spec = jax.ShapeDtypeStruct
  with aot.on_topology(TOPOLOGY[chip]):
    for d_model, dtype in ((640, jnp.bfloat16), (8192, jnp.float32)):
      pairs = spec((128 * 1000,), jnp.int32)
      args = (spec((1000, d_model), dtype), spec((4096, d_model), dtype), pairs, pairs, spec((4097,), jnp.int32))
      dots = lambda *a: tpu.row_order_dots(*a, KernelOptions("tpu"))  # noqa: E731
      jax.jit(dots).trace(*args).lower().compile()


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("budget", [2 * 2**20, 4 * 2**20])  # the slot bytes of v5p (64 MiB / 32) and v6e
def test_row_layouts_are_whole_lane_tiles_within_the_slot_budget(itemsize, budget):
  for d_model in range(128, 8192 + 1, 128):
    words, dc = tpu_layout.word_layout(d_model, itemsize, tpu_layout.ROW_BLOCK * 128, budget)
    assert words % tpu_layout.LANES == 0 and words * 4 >= d_model * itemsize
    assert dc % tpu_layout.LANES == 0 and words % dc == 0
    assert tpu_layout.ROW_BLOCK * 128 * dc * 4 <= budget or dc == tpu_layout.LANES, (d_model, dc)


@pytest.mark.parametrize("chip, cores", [("v5p", 2), ("v6e", 1)])
def test_row_kernels_lower_for_tpu_with_a_sequential_double_buffered_grid(chip, cores):
  """Each kernel is one tpu_custom_call; the row kernels' grid is (cores, steps) with the steps in order
  ("arbitrary": step j starts step j + 1's copies) and one in-order chain per TensorCore of the chip."""
  spec = jax.ShapeDtypeStruct
  options = KernelOptions("tpu")
  rows, table = spec((S, N), jnp.int32), spec((R, D), jnp.bfloat16)
  kernels = {
    "row_dots": (lambda x, w, r: tpu.row_dots(x, w, r, options), spec((N, D), jnp.bfloat16), table, rows),
    "row_accumulate": (
      lambda c, w, r: tpu.row_accumulate(c, w, r, jnp.bfloat16, options),
      spec((S, N), jnp.float32),
      table,
      rows,
    ),
    "segment_sums": (
      lambda v, t, c, s: tpu.segment_sums(v, t, c, s, options, with_coef_sums=True),
      spec((N, D), jnp.bfloat16),
      spec((N * S,), jnp.int32),
      spec((N * S,), jnp.float32),
      spec((R + 1,), jnp.int32),
    ),
  }
  with aot.on_topology(TOPOLOGY[chip]):
    texts = {name: jax.jit(f).trace(*args).lower().as_text() for name, (f, *args) in kernels.items()}
  for name, text in texts.items():
    assert hlo_text.custom_calls(text) == {("tpu_custom_call", name): 1}
    module = mosaic_modules(text)[name]
    semantics = re.search(r"dimension_semantics = \[(.*?)\]", module)[1]
    assert semantics == "#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<arbitrary>", name
    bounds = [int(b) for b in re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", module)[1].split(",")]
    if name == "segment_sums":
      assert bounds == [-(-R // tpu.SEGMENT_ROWS), 1]  # 128-row tiles, all of d_model per program
    else:
      assert bounds == [cores, N // cores // tpu_layout.ROW_BLOCK]  # 8-token steps, d_model = 640 in one chunk
      # Two slots of a step's rows, each row 640 bf16 = 320 words padded to 384 (3 lane tiles): 3 MiB of VMEM.
      buffers = re.search(r"memref<2x8x128x384xi32, #tpu.memory_space<vmem>>", module)
      assert buffers, (name, re.findall(r"memref<2x8[^>]*>", module))
