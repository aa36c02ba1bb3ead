"""The Mosaic GPU row kernels' tilings (kernels/rows/mosaic_tiling.py): their shared memory counted exactly as JAX counts
it (JAX's own check at lowering is the reference), and a tiling that fits every shipped GPU target at every ladder
rung."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_core

from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import mosaic, mosaic_tiling
from sparsetx.measure import aot
from sparsetx.models import ladder
from sparsetx.parallel import topology

H100_SMEM = 232448  # h100.txtpb's shared_memory_per_block_optin, what the kernels size themselves for there
GPU_TARGETS = ("h100", "h200", "a100")
SPARSE_TYPES = ("sgatlin", "peer", "fff")
spec = jax.ShapeDtypeStruct


def row_dots_case(n_slots, d_model, dtype, options):
  scratch = functools.partial(mosaic.row_dots_scratch, n_slots, dtype, dtype)
  tiling = mosaic_tiling.choose("row_dots", scratch, d_model, dtype.itemsize, options, H100_SMEM, reduces=True)
  args = spec((200, d_model), dtype), spec((3000, d_model), dtype), spec((n_slots, 200), jnp.int32)
  return tiling, lambda *a: mosaic.row_dots(*a, options), args


def row_accumulate_case(n_slots, d_model, dtype, options):
  scratch = functools.partial(mosaic.row_accumulate_scratch, n_slots, dtype, dtype)
  tiling = mosaic_tiling.choose("row_accumulate", scratch, d_model, dtype.itemsize, options, H100_SMEM, False)
  args = spec((n_slots, 200), jnp.float32), spec((3000, d_model), dtype), spec((n_slots, 200), jnp.int32)
  return tiling, lambda *a: mosaic.row_accumulate(*a, dtype, options), args


def segment_sums_case(n_slots, d_model, dtype, options):
  del n_slots  # the kernel walks pairs in 64-row blocks: its shared memory does not grow with the slots
  wide = options._replace(block_d=max(options.block_d, mosaic.WARPGROUP))
  scratch = functools.partial(mosaic.segment_sums_scratch, dtype)
  tiling = mosaic_tiling.choose(
    "segment_sums", scratch, d_model, dtype.itemsize, wide, H100_SMEM, False, mosaic.WARPGROUP
  )
  args = spec((200, d_model), dtype), spec((900,), jnp.int32), spec((900,), jnp.float32), spec((3001,), jnp.int32)
  return tiling, lambda *a: mosaic.segment_sums(*a, options, with_coef_sums=True), args


def lowers(kernel, args) -> bool:
  """Whether JAX lowers the kernel for an H100; False when its shared-memory check refuses it."""
  with aot.on_topology("h100:1x1x1"):
    try:
      jax.jit(kernel).trace(*args).lower()
    except Exception as error:
      if "exceeds available shared memory" not in str(error):
        raise
      return False
  return True


@pytest.mark.parametrize(
  "case, n_slots, d_model, dtype, options",
  [
    (row_dots_case, 128, 512, jnp.bfloat16, KernelOptions()),  # sgatlin's 16 x 8 slots, ladder scale 4
    (row_dots_case, 96, 384, jnp.float32, KernelOptions()),  # the acceptance check's case: 3 stages do not fit
    (row_accumulate_case, 300, 256, jnp.bfloat16, KernelOptions(stages=4)),  # two 256-slot boxes
    (segment_sums_case, 0, 512, jnp.bfloat16, KernelOptions()),
  ],
)
def test_counted_shared_memory_is_what_jax_checks(monkeypatch, case, n_slots, d_model, dtype, options):
  """With JAX's shared-memory bound at the count the kernel lowers, one byte under it JAX refuses it: the count
  is JAX's to the byte (buffers rounded to 1 KiB, reduction scratch, barriers)."""
  tiling, kernel, args = case(n_slots, d_model, jnp.dtype(dtype), options)
  assert tiling.block_d <= options.block_d and tiling.stages <= options.stages
  monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", tiling.smem_bytes)
  assert lowers(kernel, args)
  monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", tiling.smem_bytes - 1)
  assert not lowers(kernel, args)


def test_the_acceptance_case_drops_a_stage_where_three_do_not_fit():
  """1,000 tokens, 96 slots, D 384 in float32 (the acceptance check's case) was refused at 245,760 bytes with the
  defaults; the user's block_d and stages are upper bounds, so it keeps block_d 128 with two stages."""
  tiling, _, _ = row_dots_case(96, 384, jnp.dtype(jnp.float32), KernelOptions())
  assert (tiling.block_d, tiling.stages) == (128, 2) and tiling.smem_bytes <= H100_SMEM


def test_a_kernel_no_tiling_fits_is_refused_in_one_line():
  with pytest.raises(ValueError, match="row_dots kernel needs .* bytes of shared memory at its smallest tiling") as e:
    row_dots_case(512, 256, jnp.dtype(jnp.bfloat16), KernelOptions())  # 512 slots: 256 KiB of rows and dots alone
  assert "kernel.implementation='triton'" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ValueError, match="d_model=96 has no chunk <= kernel.block_d=128"):
    row_dots_case(8, 96, jnp.dtype(jnp.bfloat16), KernelOptions())


def ladder_shapes():
  """(type, scale, d_model, slots per call) of every sparse rung of the ladder (slots: sgatlin / PEER C * K,
  FFF's whole paths P * L, more than any one walk level reads)."""
  for ffn_type in SPARSE_TYPES:
    for scale in ladder.SCALES:
      model = ladder.ladder_model_config(scale, ffn_type)
      ffn = model.ffn
      slots = ffn.n_trees * (ffn.depth + 1) if ffn_type == "fff" else ffn.n_channels * ffn.top_k
      yield ffn_type, scale, model.d_model, slots


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_every_ladder_rung_has_a_tiling_that_fits_each_gpu(target):
  """For each shipped GPU target (its shared memory read from its target file, as the topology's devices report
  it) and every rung's d_model and slot count, in bf16 and float32, each kernel gets a tiling of at least two
  stages whose shared memory fits."""
  smem = topology.devices(f"{target}:1x1x1")[0].shared_memory_per_block_optin
  kernels = {
    "row_dots": (mosaic.row_dots_scratch, True, 1),
    "row_accumulate": (mosaic.row_accumulate_scratch, False, 1),
    "segment_sums": (None, False, mosaic.WARPGROUP),
  }
  for ffn_type, scale, d_model, slots in ladder_shapes():
    for dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
      for kernel, (scratch, reduces, multiple) in kernels.items():
        if scratch is None:
          scratch_of = functools.partial(mosaic.segment_sums_scratch, dtype)
        else:
          scratch_of = functools.partial(scratch, slots, dtype, dtype)
        options = KernelOptions(block_d=max(KernelOptions().block_d, multiple))
        tiling = mosaic_tiling.choose(kernel, scratch_of, d_model, dtype.itemsize, options, smem, reduces, multiple)
        where = (target, ffn_type, scale, dtype.name, kernel, tiling)
        assert tiling.stages >= mosaic_tiling.MIN_STAGES and tiling.smem_bytes <= smem, where
