"""The Mosaic GPU row kernels' tilings: each kernel's shared memory counted as JAX counts it, and the largest
tiling under the user's `kernel.block_d` and `kernel.stages` that fits the target device's shared memory per block.

JAX (Pallas Mosaic GPU) rounds every scratch buffer up to 1 KiB, reserves reduction scratch for a kernel with a
reduction and allocates 8 bytes per barrier after the buffers; it refuses a kernel over the device's
`shared_memory_per_block_optin` (227 KiB on H100 / H200, and its default when compiling without a device).
tests/test_mosaic_tiling.py holds this count to JAX's own check.
"""

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_ALIGNMENT = 1024  # each scratch buffer starts on a 1 KiB boundary
REDUCTION_SCRATCH = 128 * 4 * 4  # plgpu.CompilerParams.reduction_scratch_bytes' default
MBARRIER_BYTES = 8
DEFAULT_SMEM_PER_BLOCK = 227 * 1024  # what JAX assumes without a device: sm_90 and sm_100
MIN_STAGES = 2  # below two tiles in flight the copies no longer overlap the arithmetic


class Tiling(NamedTuple):
  block_d: int  # d_model values per gathered row copy
  stages: int  # gathered tiles in flight
  smem_bytes: int  # what the kernel asks of shared memory, counted as JAX counts it


def smem_bytes(scratch_types, reduces: bool) -> int:
  """Shared memory of a kernel with these scratch types (plgpu.SMEM buffers and plgpu.Barrier groups)."""
  buffers, barriers = 0, 0
  for scratch in scratch_types:
    if isinstance(scratch, plgpu.Barrier):
      count = scratch.num_barriers  # an int, or a shape (jax 0.12)
      barriers += math.prod(count) if isinstance(count, tuple) else count
    else:
      nbytes = math.prod(scratch.shape) * jnp.dtype(scratch.dtype).itemsize
      buffers += -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
  reduction = -(-REDUCTION_SCRATCH // SMEM_ALIGNMENT) * SMEM_ALIGNMENT if reduces else 0
  return buffers + reduction + barriers * MBARRIER_BYTES


def copy_step(itemsize: int, multiple: int = 1) -> int:
  """The values one row copy moves a multiple of: 128 bytes (a TMA copy), and `multiple` (segment_sums spreads a
  row chunk over a warpgroup's threads)."""
  return math.lcm(max(1, 128 // itemsize), multiple)


def block_d_choices(d_model: int, itemsize: int, upper: int, multiple: int = 1) -> list[int]:
  """Every chunk <= upper that divides d_model and is a multiple of copy_step, largest first."""
  step = copy_step(itemsize, multiple)
  return [b for b in range(min(upper, d_model) // step * step, 0, -step) if d_model % b == 0]


def choose(kernel: str, scratch_of, d_model, itemsize, options, smem_per_block, reduces, multiple=1) -> Tiling:
  """The largest block_d, then the most stages (both at most the user's kernel.block_d and kernel.stages) whose
  scratch_of(block_d, stages) fits `smem_per_block`; a ValueError naming the knob when none does."""
  widths = block_d_choices(d_model, itemsize, options.block_d, multiple)
  if not widths:
    why = "TMA copies move multiples of 128 bytes" + (f"; a chunk spans {multiple} threads" if multiple > 1 else "")
    raise ValueError(
      f"d_model={d_model} has no chunk <= kernel.block_d={options.block_d} that is a multiple of "
      f"{copy_step(itemsize, multiple)} values ({why}); raise block_d or use kernel.implementation='triton'."
    )
  fewest = min(MIN_STAGES, options.stages)
  for block_d in widths:
    for stages in range(options.stages, fewest - 1, -1):
      needed = smem_bytes(scratch_of(block_d, stages), reduces)
      if needed <= smem_per_block:
        return Tiling(block_d, stages, needed)
  smallest = smem_bytes(scratch_of(widths[-1], fewest), reduces)
  raise ValueError(
    f"the Mosaic GPU {kernel} kernel needs {smallest} bytes of shared memory at its smallest tiling "
    f"(block_d={widths[-1]}, stages={fewest}), over the device's {smem_per_block} per block; "
    "use kernel.implementation='triton'."
  )
