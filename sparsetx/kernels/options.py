"""The gated gather's static knobs and their allowed values, read from `config.model.ffn.kernel`.

Kernels own these choices; the config schema (`config.model.ffn.kernel`) holds the users' defaults and the
feed-forward specs check a config's values against the tuples here.
"""

from typing import NamedTuple

from sparsetx.config import GPU_KERNELS, KERNEL_IMPLEMENTATIONS  # noqa: F401 (re-exported: the kernels' names)

IMPLEMENTATIONS = KERNEL_IMPLEMENTATIONS  # xla | pallas | auto | reference: platform.kernel_backend
# GPU_KERNELS: mosaic (Hopper and newer) | triton | auto


class KernelOptions(NamedTuple):
  """Static knobs of the op (hashable, so they can ride along as a nondiff argument)."""

  implementation: str = "auto"
  token_chunk: int = 4  # xla path on CPU: tokens whose gathered rows exist at once (platform.cpu_chunk)
  pair_chunk: int = 2048  # xla path on CPU: sorted (token, slot) pairs added per table-gradient step
  block_tokens: int = 8  # pallas (triton): tokens per program (grid step)
  block_d: int = 128  # pallas on gpu: d_model chunk (mosaic: one gathered row copy; triton: a power of two <= it)
  stages: int = 3  # pallas (mosaic gpu): gathered [64, block_d] tiles in flight
  gpu_kernel: str = "auto"  # pallas on GPU: mosaic (Hopper and newer) | triton | auto (platform.gpu_kernel)
  interpret: bool = False  # pallas: run the kernels in interpret mode (tests on CPU)
  row_sorted: bool = True  # xla on CPU, with gradients: one row-order sort and walk (xla_gather.row_sorted_*)
  segment_chunk: int = 64  # pallas, table gradients: a row's pairs per segment; longer rows are cut (0: never)
  group_rows: int = 128  # moe's grouped matmul: rows of one expert per tile (a power of two; Mosaic GPU: >= 64)


def options_from_config(kernel_cfg) -> KernelOptions:
  """KernelOptions from `config.model.ffn.kernel` (None gives the defaults)."""
  if kernel_cfg is None:
    return KernelOptions()
  return KernelOptions(
    implementation=kernel_cfg.implementation,
    token_chunk=kernel_cfg.token_chunk,
    pair_chunk=kernel_cfg.pair_chunk,
    block_tokens=kernel_cfg.block_tokens,
    row_sorted=bool(kernel_cfg.get("row_sorted", True)),
    block_d=kernel_cfg.get("block_d", KernelOptions._field_defaults["block_d"]),  # configs saved before the field
    stages=kernel_cfg.get("stages", KernelOptions._field_defaults["stages"]),
    gpu_kernel=kernel_cfg.get("gpu_kernel", KernelOptions._field_defaults["gpu_kernel"]),
    group_rows=kernel_cfg.get("group_rows", KernelOptions._field_defaults["group_rows"]),
    segment_chunk=kernel_cfg.get("segment_chunk", KernelOptions._field_defaults["segment_chunk"]),
  )
