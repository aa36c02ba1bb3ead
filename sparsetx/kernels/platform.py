"""The one place that decides, by platform, which program the sparse layers become.

A GPU or TPU runs the row kernels (row_dots, row_accumulate, segment_sums) of one backend module: Mosaic GPU
on Hopper and newer, the Triton lowering on older GPUs, Pallas TPU on TPU. Everything a sparse layer does
with a table (the gated gather's forward and backward, FFF's deeper walk levels, the d-split's partial dots,
the table gradients) is a fixed number of kernel launches whatever the token count.

A CPU runs XLA code shaped for its caches: `lax.scan`s over token chunks, pair chunks and row-sorted walks.
Those loop sizes come from `cpu_chunk` alone, which on any other platform answers "everything at once", so a
GPU/TPU program that takes the XLA path (`kernel.implementation=xla`) never inherits a cache-sized loop.
"""

import jax

from sparsetx.kernels.options import GPU_KERNELS, IMPLEMENTATIONS, KernelOptions


def on_cpu() -> bool:
  """Whether the program being traced is for a CPU (tools lowering for cuda/tpu patch jax.default_backend)."""
  return jax.default_backend() == "cpu"


def cpu_chunk(size: int, n: int) -> int:
  """The chunk of n items a CPU loop takes per step (`size`, a cache-sized knob); n itself elsewhere."""
  return max(1, min(size, n)) if on_cpu() else max(1, n)


def kernel_backend(options: KernelOptions):
  """The backend module whose row kernels this call runs, or None for the XLA path (xla_gather.py)."""
  implementation = options.implementation
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"kernel implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}.")
  platform = jax.default_backend()
  if implementation == "auto":
    implementation = "pallas" if platform in ("gpu", "tpu") else "xla"
  if implementation == "xla":
    return None
  if platform == "tpu":
    from sparsetx.kernels import pallas_tpu

    return pallas_tpu
  if gpu_kernel(options, platform) == "mosaic":
    from sparsetx.kernels import mosaic_gpu

    return mosaic_gpu
  from sparsetx.kernels import pallas_gpu  # Triton: GPU, or interpret mode anywhere else

  return pallas_gpu


def gpu_kernel(options: KernelOptions, platform: str) -> str:
  """mosaic on Hopper and newer (sm_90+); triton on older GPUs and, by default, in interpret mode off GPU
  (the generic interpreter is much faster than Mosaic GPU's simulation of TMA and barriers)."""
  choice = options.gpu_kernel
  if choice not in GPU_KERNELS:
    raise ValueError(f"kernel gpu_kernel={choice!r} is unknown; use one of {GPU_KERNELS}.")
  if choice != "auto":
    return choice
  if platform != "gpu":
    return "triton"
  capability = getattr(jax.devices()[0], "compute_capability", "0")
  return "mosaic" if float(capability) >= 9.0 else "triton"
