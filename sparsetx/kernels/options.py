"""The gated gather's static knobs and their allowed values, read from `config.model.ffn.kernel`.

Kernels own these choices; the config schema (`config.model.ffn.kernel`) holds the users' defaults and the
feed-forward specs check a config's values against the tuples here.
"""

from typing import NamedTuple

from sparsetx.config import kernel_defaults

_DEFAULTS = kernel_defaults()  # config.model.ffn.kernel's defaults, written once in the schema (its comments say why)


class KernelOptions(NamedTuple):
  """Static knobs of the op (hashable, so they can ride along as a nondiff argument)."""

  implementation: str = _DEFAULTS.implementation  # auto | reference | a registry name | "a,b": kernels/registry.py
  token_chunk: int = _DEFAULTS.token_chunk
  pair_chunk: int = _DEFAULTS.pair_chunk
  block_tokens: int = _DEFAULTS.block_tokens
  block_d: int = _DEFAULTS.block_d  # an upper bound: mosaic_tiling and the Triton chunk take what fits
  stages: int = _DEFAULTS.stages  # an upper bound (mosaic_tiling)
  interpret: bool = False  # pallas: run the kernels in interpret mode (tests on CPU); not a config knob
  row_sorted: bool = _DEFAULTS.row_sorted
  segment_chunk: int = _DEFAULTS.segment_chunk
  group_rows: int = _DEFAULTS.group_rows


def options_from_config(kernel_cfg) -> KernelOptions:
  """KernelOptions from `config.model.ffn.kernel` (None gives the defaults; a config saved before a field takes its
  default)."""
  if kernel_cfg is None:
    return KernelOptions()
  return KernelOptions(
    **{
      field: kernel_cfg.get(field, default)
      for field, default in KernelOptions._field_defaults.items()
      if field != "interpret"
    }
  )
