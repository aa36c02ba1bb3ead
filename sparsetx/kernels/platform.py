"""The platform switch: whether the program being traced is for a CPU (where cache-sized chunks apply), and which
GPUs Mosaic GPU runs on. Which implementation runs each kernel op is kernels/registry.py's.

The target is the device the program being traced is for: the active mesh's (`jax.set_mesh`), whose devices may
be a topology's (a TPU pod or GPU node this machine only compiles for), else this process's first device. No
kernel or layer reads `jax.default_backend()`: a program compiled here for a v5p or an H100 takes that
machine's kernels.

More: docs/modules.md, sparsetx/kernels/platform.py.
"""

import re

from sparsetx.kernels.device import target

# Hopper (H100, H200, H800, H20, GH200) and Blackwell (B200, GB200) parts: compute capability 9.0 and newer.
_HOPPER_OR_NEWER = re.compile(r"\b(G?H\d{2,3}|G?B\d{3})\b")


def on_cpu() -> bool:
  """Whether the program being traced is for a CPU."""
  return target().platform == "cpu"


def cpu_chunk(size: int, n: int) -> int:
  """The chunk of n items a CPU loop takes per step (`size`, a cache-sized knob); n itself elsewhere."""
  return max(1, min(size, n)) if on_cpu() else max(1, n)


def hopper_or_newer(device_kind: str) -> bool:
  """Whether a GPU's device kind names a Hopper or newer part (sm_90+), where Mosaic GPU runs."""
  return bool(_HOPPER_OR_NEWER.search(device_kind))
