"""Size-capped safetensors shards and their index, named as transformers' save_pretrained names them.

The plan is huggingface_hub's own (split_state_dict_into_shards_factory, on the tensors' sizes alone): tensors in
order fill a shard until the next would pass the cap; a tensor larger than the cap gets a shard of its own. One shard
is `model.safetensors` with no index; n shards are `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`.
"""

import re

from huggingface_hub.serialization import split_state_dict_into_shards_factory

from sparsetx.config import ConfigError

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
  """Bytes of '5GB', '500MB', '2GiB' or a plain count (transformers' units: GB is 10**9 bytes)."""
  found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
  unit = found.group(2).upper() if found else None
  if unit not in _UNITS or float(found.group(1)) * _UNITS[unit] < 1:
    raise ConfigError(
      f"--max_shard_size={size!r} is not a positive size; give bytes with a unit, e.g. 5GB (the default) or 500MB."
    )
  return int(float(found.group(1)) * _UNITS[unit])


def plan(sizes: dict[str, int], cap: int) -> dict[str, list[str]]:
  """{file name: its tensors' names, in order} for tensors of `sizes` (bytes, in the order written)."""
  split = split_state_dict_into_shards_factory(
    sizes, get_storage_size=lambda size: size, filename_pattern="model{suffix}.safetensors", max_shard_size=cap
  )
  return split.filename_to_tensors if sizes else {WEIGHTS: []}


def index(files: dict[str, list[str]], sizes: dict[str, int]) -> dict:
  """model.safetensors.index.json's content for a sharded plan."""
  return {
    "metadata": {"total_size": sum(sizes.values())},
    "weight_map": {name: file for file, names in files.items() for name in names},
  }
