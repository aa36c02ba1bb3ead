"""Export's host memory does not grow with the model (sparsetx/hf/export.py, sparsetx-bench-export): the peak RSS of
an export, measured in a child process of its own, grows from one layer to sixteen by no more than the
bound the reader and writer allow (the larger model's weights, 270 MB, are 2.7 times that bound).

The slack, derived: a shard's arrays are held while it is written (at most the cap, or one tensor larger than it,
in a shard of its own); orbax hands each array over as numpy through a second buffer of its size while it reads
(one more largest tensor); tensorstore's and the allocator's buffers are a constant, taken as 64 MiB (the bench
measured under 0.98 x (cap + largest) at 80M and 599M parameters, so these terms are not tight)."""

import math

import pytest
from test_train import micro_config

from sparsetx.hf import lazy_tensors
from sparsetx.tools import bench_export

CAP = 8 * 10**6


@pytest.mark.long  # two checkpoints written and two exports in child processes
def test_peak_rss_grows_by_at_most_one_shard_and_two_largest_tensors(tmp_path):
  peaks, largest = {}, {}
  for name, n_layers in (("small", 1), ("large", 16)):
    config = micro_config("sgatlin")
    config.model.update(d_model=128, head_dim=64, n_layers=n_layers)
    config.model.ffn.update(d_ffw=1024, n_channels=16)  # a table of 16 x 1024 x 2 x 128 floats (16.8 MB) a layer
    bench_export.write_checkpoint(config, str(tmp_path / name))
    found = bench_export.measured_export(str(tmp_path / name), str(tmp_path / f"{name}-hf"), str(CAP))
    peaks[name] = found["peak_rss"]
    largest[name] = max(4 * math.prod(s) for s in lazy_tensors.param_shapes(config.model).values())
    assert found["shards"] >= (16 if name == "large" else 1), found
  growth = peaks["large"] - peaks["small"]
  assert largest["large"] > CAP  # the table is a shard of its own: the case that reads most at once
  assert growth <= max(CAP, largest["large"]) + largest["large"] + 64 * 2**20, (growth, largest)
