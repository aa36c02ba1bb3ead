"""Export's shards (sparsetx/hf/shards.py) are named and filled as huggingface_hub splits a state dict for
transformers' save_pretrained, a tensor larger than the cap included, and bad sizes are one sentence."""

import numpy as np
import pytest
from huggingface_hub.serialization import split_state_dict_into_shards_factory

from sparsetx.config import ConfigError
from sparsetx.hf import shards


@pytest.mark.parametrize(
  "sizes, cap",
  [
    ([6, 6, 2, 6, 2, 2], 10),  # huggingface_hub's own example: [6], [6+2], [6+2+2]
    ([3, 25, 4, 4, 1, 9, 9], 10),  # a tensor over the cap: a shard of its own, before the one being filled
    ([4, 4], 100),  # one shard: model.safetensors, no index
    ([10, 10, 10], 10),  # exactly the cap
  ],
)
def test_the_plan_and_index_are_huggingface_hubs(sizes, cap):
  named = {f"layers.{i}.w": size for i, size in enumerate(sizes)}
  reference = split_state_dict_into_shards_factory(
    {name: np.zeros(size, np.uint8) for name, size in named.items()},
    get_storage_size=lambda array: array.nbytes,
    filename_pattern="model{suffix}.safetensors",
    max_shard_size=cap,
  )
  files = shards.plan(named, cap)
  assert files == reference.filename_to_tensors
  if reference.is_sharded:
    assert shards.index(files, named) == {"metadata": reference.metadata, "weight_map": reference.tensor_to_filename}


def test_sizes_read_as_transformers_reads_them_and_bad_ones_are_one_sentence():
  assert shards.parse_size("5GB") == 5 * 10**9 and shards.parse_size("200KB") == 200_000
  assert shards.parse_size("2GiB") == 2 * 2**30 and shards.parse_size(4096) == 4096
  for bad in ("0", "0GB", "-5GB", "5 parsecs", ""):
    with pytest.raises(ConfigError, match=r"--max_shard_size=.* is not a positive size; give bytes with a unit"):
      shards.parse_size(bad)
