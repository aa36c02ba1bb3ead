"""The platform switch: whether the program being traced is for a CPU (where cache-sized chunks apply), which GPUs
Mosaic GPU runs on, and where each implementation of a kernel op runs (OnPlatform). Which implementation runs each
kernel op is kernels/registry.py's.

The target is the device the program being traced is for: the active mesh's (`jax.set_mesh`), whose devices may
be a topology's (a TPU pod or GPU node this machine only compiles for), else this process's first device. No
kernel or layer reads `jax.default_backend()`: a program compiled here for a v5p or an H100 takes that
machine's kernels.

More: docs/modules.md, sparsetx/kernels/platform.py.
"""

import dataclasses
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


@dataclasses.dataclass(frozen=True, eq=False)
class OnPlatform:
  """Where an implementation of a kernel op runs: natively on `platform` (with what `needs` asks of the device: a
  (predicate, description) pair; None: XLA's, every platform), refused on the accelerators in `refused_on`, and
  elsewhere (a CPU) in interpret mode when named (the registry tries one off its platform only then).
  `interprets_by_default`: a family whose interpreter is fast enough for the CPU's checks of every kernel (Triton's
  generic one; Mosaic GPU's simulation of TMA and barriers is not): registry.runs_here(interpreted=True). `tilings`:
  what sparsetx-autotune --tilings measures beside the config's knobs. Compared by identity (a nondiff argument of
  the ops' custom VJPs)."""

  name: str
  platform: str | None
  _: dataclasses.KW_ONLY
  needs: tuple | None = None
  refused_on: tuple = ()
  interprets_by_default: bool = False
  tilings: tuple = ()

  def refuse(self, device, options, call=None) -> None:
    """Raises NotImplementedError with the reason where this implementation cannot take this call on `device`."""
    del options, call
    if self.platform is None:
      return
    if device.platform in self.refused_on:
      raise NotImplementedError(f"it runs on {self.platform.upper()}s, not on a {device.platform.upper()}")
    if device.platform == self.platform and self.needs and not self.needs[0](device):
      raise NotImplementedError(f"it needs {self.needs[1]}; {device.device_kind} is not one")
