"""The device the program being traced is for (a leaf: the platform switch and every kernel backend read it).

The active mesh's devices (`jax.set_mesh`), whose devices may be a topology's (a TPU pod or GPU node this machine
only compiles for, parallel/topology.py), else this process's first device.
"""

from typing import NamedTuple

import jax

from sparsetx import hardware


class TracedDevice(NamedTuple):
  platform: str  # cpu | gpu | tpu
  device_kind: str  # 'TPU v5', 'NVIDIA H100 80GB HBM3', 'cpu'
  num_cores: int | None  # TensorCores per TPU chip; SMs of a GPU (None where unknown)
  shared_memory_per_block: int | None = None  # a GPU's opt-in shared memory per block, bytes (None where unknown)


def target() -> TracedDevice:
  """The device the program being traced is for: the active mesh's devices, else this process's first."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  if device is not None:  # an abstract device names its kind only: the chip table has its shared memory
    return TracedDevice(device.platform, device.device_kind, device.num_cores, _chip_shared_memory(device.device_kind))
  device = jax.devices()[0]
  smem = getattr(device, "shared_memory_per_block_optin", None) or _chip_shared_memory(device.device_kind)
  return TracedDevice(device.platform, device.device_kind, getattr(device, "num_cores", None), smem)


def _chip_shared_memory(device_kind: str) -> int | None:
  chip = hardware.chip_of(device_kind)
  return chip.shared_memory_per_block if chip else None


def interpret_off(native: str, options) -> bool:
  """Whether a kernel meant for `native` (gpu | tpu) runs in interpret mode: asked for (options.interpret), or
  traced for another platform (tests on the CPU)."""
  return options.interpret or target().platform != native
