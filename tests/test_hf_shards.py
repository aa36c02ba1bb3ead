"""Export's shards (sparsetx/hf/shards.py) are named and filled as transformers' save_pretrained shards a state dict
(huggingface_hub's split_state_dict_into_shards_factory), checked against groupings worked out by hand from that rule,
and bad sizes are one sentence.

The rule: tensors in order fill the current shard; one that would take it past the cap closes it and starts the next;
a tensor larger than the cap gets a shard of its own at once, ahead of the one being filled. One shard is
model.safetensors with no index; n shards are model-0000i-of-0000n.safetensors (5 digits each), with an index of the
total bytes and each tensor's file.
"""

import pytest

from sparsetx.config import ConfigError
from sparsetx.hf import shards

CASES = {  # name: (tensor sizes in order, cap, {file: its tensors}, total bytes), the files worked out by hand
  "huggingface_hub's own example": (
    [6, 6, 2, 6, 2, 2],
    10,
    {
      "model-00001-of-00003.safetensors": ["t0"],
      "model-00002-of-00003.safetensors": ["t1", "t2"],
      "model-00003-of-00003.safetensors": ["t3", "t4", "t5"],
    },
    24,
  ),
  "a tensor over the cap, ahead of the shard being filled": (
    [3, 25, 4, 4, 1, 9, 9],
    10,
    {
      "model-00001-of-00005.safetensors": ["t1"],
      "model-00002-of-00005.safetensors": ["t0", "t2"],
      "model-00003-of-00005.safetensors": ["t3", "t4"],
      "model-00004-of-00005.safetensors": ["t5"],
      "model-00005-of-00005.safetensors": ["t6"],
    },
    55,
  ),
  "the first tensor over the cap": (
    [11, 1, 1],
    10,
    {"model-00001-of-00002.safetensors": ["t0"], "model-00002-of-00002.safetensors": ["t1", "t2"]},
    13,
  ),
  "a shard of exactly the cap": (
    [4, 6, 10],
    10,
    {"model-00001-of-00002.safetensors": ["t0", "t1"], "model-00002-of-00002.safetensors": ["t2"]},
    20,
  ),
  "one byte over the cap does not": (
    [4, 6, 1, 9, 2],
    10,
    {
      "model-00001-of-00003.safetensors": ["t0", "t1"],
      "model-00002-of-00003.safetensors": ["t2", "t3"],
      "model-00003-of-00003.safetensors": ["t4"],
    },
    22,
  ),
  "one shard: model.safetensors": ([4, 4], 100, {"model.safetensors": ["t0", "t1"]}, 8),
  "more than 9 shards": (
    [5] * 12,
    5,
    {
      "model-00001-of-00012.safetensors": ["t0"],
      "model-00002-of-00012.safetensors": ["t1"],
      "model-00003-of-00012.safetensors": ["t2"],
      "model-00004-of-00012.safetensors": ["t3"],
      "model-00005-of-00012.safetensors": ["t4"],
      "model-00006-of-00012.safetensors": ["t5"],
      "model-00007-of-00012.safetensors": ["t6"],
      "model-00008-of-00012.safetensors": ["t7"],
      "model-00009-of-00012.safetensors": ["t8"],
      "model-00010-of-00012.safetensors": ["t9"],
      "model-00011-of-00012.safetensors": ["t10"],
      "model-00012-of-00012.safetensors": ["t11"],
    },
    60,
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_and_index_follow_save_pretrained(case):
  sizes, cap, files, total = CASES[case]
  named = {f"t{i}": size for i, size in enumerate(sizes)}
  planned = shards.plan(named, cap)
  assert planned == files and list(planned) == list(files)
  assert all(sum(named[t] for t in tensors) <= cap or len(tensors) == 1 for tensors in planned.values())
  if len(files) > 1:
    assert shards.index(planned, named) == {
      "metadata": {"total_size": total},
      "weight_map": {tensor: file for file, tensors in files.items() for tensor in tensors},
    }


def test_sizes_read_as_transformers_reads_them_and_bad_ones_are_one_sentence():
  assert shards.parse_size("5GB") == 5 * 10**9 and shards.parse_size("200KB") == 200_000
  assert shards.parse_size("2GiB") == 2 * 2**30 and shards.parse_size(4096) == 4096
  for bad in ("0", "0GB", "-5GB", "5 parsecs", ""):
    with pytest.raises(ConfigError, match=r"--max_shard_size=.* is not a positive size; give bytes with a unit"):
      shards.parse_size(bad)
