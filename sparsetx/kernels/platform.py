"""The one place that decides, by the target device, which program the sparse layers become.

The target is the device the program being traced is for: the active mesh's (`jax.set_mesh`), whose devices may
be a topology's (a TPU pod or GPU node this machine only compiles for), else this process's first device. No
kernel or layer reads `jax.default_backend()`: a program compiled here for a v5p or an H100 takes that
machine's kernels.

More: docs/modules.md, sparsetx/kernels/platform.py.
"""

import re

from sparsetx.kernels.device import TracedDevice, target
from sparsetx.kernels.options import GPU_KERNELS, IMPLEMENTATIONS, KernelOptions

# Hopper (H100, H200, H800, H20, GH200) and Blackwell (B200, GB200) parts: compute capability 9.0 and newer.
_HOPPER_OR_NEWER = re.compile(r"\b(G?H\d{2,3}|G?B\d{3})\b")


def on_cpu() -> bool:
  """Whether the program being traced is for a CPU."""
  return target().platform == "cpu"


def cpu_chunk(size: int, n: int) -> int:
  """The chunk of n items a CPU loop takes per step (`size`, a cache-sized knob); n itself elsewhere."""
  return max(1, min(size, n)) if on_cpu() else max(1, n)


def kernel_backend(options: KernelOptions):
  """The backend module (a backend.RowKernels) whose row kernels this call runs, or None for the XLA path."""
  implementation = options.implementation
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"kernel implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}.")
  device = target()
  if implementation == "auto":
    implementation = "pallas" if device.platform in ("gpu", "tpu") else "xla"
  if implementation in ("xla", "reference"):
    return None
  if device.platform == "tpu":
    from sparsetx.kernels import pallas_tpu

    return pallas_tpu
  if gpu_kernel(options, device) == "mosaic":
    from sparsetx.kernels import mosaic_gpu

    return mosaic_gpu
  from sparsetx.kernels import pallas_gpu  # Triton: GPU, or interpret mode anywhere else

  return pallas_gpu


def hopper_or_newer(device_kind: str) -> bool:
  """Whether a GPU's device kind names a Hopper or newer part (sm_90+), where Mosaic GPU runs."""
  return bool(_HOPPER_OR_NEWER.search(device_kind))


# The Mosaic GPU kernels seen running on a Hopper GPU under the supported JAX (0.11.2, 0.12): `auto` takes Mosaic GPU
# for these alone. MoE's grouped matmul (JAX's own ragged dot) matched ragged_dot on an H200 under 0.11.2. The row
# kernels lower for sm_90a (tests/test_kernels_pallas.py) and equal the XLA path in Mosaic GPU's interpreter, but have
# not run on a GPU under jax >= 0.11 (segment_sums stopped there with an illegal instruction, cause unknown): add
# "rows" once sparsetx-accelerator-check passes with them on an H100 / H200 (docs/measurements.md).
MOSAIC_SEEN_RUNNING = frozenset({"grouped_matmul"})


def gpu_kernel(options: KernelOptions, device: TracedDevice, kernels: str = "rows") -> str:
  """The GPU kernel family for `kernels` (rows | grouped_matmul): the user's choice, or for `auto` mosaic on
  Hopper and newer (sm_90+) where MOSAIC_SEEN_RUNNING holds them, triton elsewhere, and by default in interpret mode
  off GPU (the generic interpreter is much faster than Mosaic GPU's simulation of TMA and barriers)."""
  choice = options.gpu_kernel
  if choice not in GPU_KERNELS:
    raise ValueError(f"kernel gpu_kernel={choice!r} is unknown; use one of {GPU_KERNELS}.")
  if choice != "auto":
    return choice
  hopper = device.platform == "gpu" and hopper_or_newer(device.device_kind)
  return "mosaic" if hopper and kernels in MOSAIC_SEEN_RUNNING else "triton"
