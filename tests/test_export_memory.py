"""Export's and import's host memory do not grow with the model (sparsetx/hf/export.py, sparsetx-bench-export): the
peak RSS of an export and of its import, each measured in a child process of its own, grows from one layer to
sixteen by no more than the bound the readers and writers allow.

The bound, derived. Export: a shard's arrays are held while it is written (at most the cap, or one tensor larger
than it, in a shard of its own); orbax hands each array over as numpy through a second buffer of its size while it
reads (one more largest tensor). Import: a group is written once it reaches half the cap (less than half the cap
plus one tensor held); a tensor is read into a buffer of its size before numpy takes it, and moved into a jax array
(one more largest tensor each, at most). Tensorstore's, orbax's and the allocator's buffers and a run's noise make
the rest, taken as 128 MiB: one export of one checkpoint peaked 26 MB apart in two runs, and the 16-layer model's
export grew 100 to 140 MB against the 34 MB of the terms above. Holding the model's 270 MB breaks either bound."""

import math

import pytest
from test_train import micro_config

from sparsetx.hf import lazy_tensors
from sparsetx.tools import bench_export

CAP = 8 * 10**6
SLACK = 128 * 2**20


@pytest.mark.long  # two checkpoints written and two exports in child processes
def test_peak_rss_of_export_and_import_grows_by_at_most_one_shard_and_two_largest_tensors(tmp_path):
  peaks, import_peaks, largest = {}, {}, {}
  for name, n_layers in (("small", 1), ("large", 16)):
    config = micro_config("sgatlin")
    config.model.update(d_model=128, head_dim=64, n_layers=n_layers)
    config.model.ffn.update(d_ffw=1024, n_channels=16)  # a table of 16 x 1024 x 2 x 128 floats (16.8 MB) a layer
    bench_export.write_checkpoint(config, str(tmp_path / name))
    found = bench_export.measured("export", str(tmp_path / name), str(tmp_path / f"{name}-hf"), str(CAP))
    peaks[name] = found["peak_rss"]
    imported = bench_export.measured("import", str(tmp_path / f"{name}-hf"), str(tmp_path / f"{name}-back"), str(CAP))
    import_peaks[name] = imported["peak_rss"]
    largest[name] = max(4 * math.prod(s) for s in lazy_tensors.param_shapes(config.model).values())
    assert found["shards"] >= (16 if name == "large" else 1), found
  assert largest["large"] > CAP  # the table is a shard of its own: the case that reads most at once
  bound = max(CAP, largest["large"]) + largest["large"] + SLACK
  assert peaks["large"] - peaks["small"] <= bound, (peaks, largest)
  assert import_peaks["large"] - import_peaks["small"] <= CAP + 2 * largest["large"] + SLACK, (
    import_peaks,
    largest,
  )
