"""sparsetx-bench-data: both input paths read the benchmark's text (a pre-tokenized row is a stretch of one input
file, an on-the-fly segment a piece of one document), in batches of the same shape; the table has a row per path
and the bar's rows; the bar is the dry run's analytic projection on the mesh the target builds. No timing is
asserted."""

import jax
import numpy as np
import pytest
from conftest import REPO

from sparsetx import config as config_lib
from sparsetx.data import vocab
from sparsetx.parallel import hardware, targets
from sparsetx.tools import bench_data
from sparsetx.train import layer_cost
from sparsetx.train import state as state_lib

BAR = f"{REPO}/configs/ladder.py:sgatlin,5,h100x8"
ROWS, SEQ_LEN = 8, 64


@pytest.fixture(scope="module")
def bar():
  return bench_data.training_bar(BAR)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  work_dir = str(tmp_path_factory.mktemp("bench"))
  return bench_data.prepare(work_dir, megabytes=0.05, vocab_size=300, seq_len=SEQ_LEN, rows=ROWS)


def pieces(vocabulary, tokens) -> list[tuple[str, bool]]:
  """(text, ends its document) of each run of `tokens` between EOS ids (seqio's decode stops at EOS)."""
  eos = vocabulary.eos_id
  cut = np.split(tokens, np.flatnonzero(tokens == eos) + 1)
  return [(vocabulary.decode(p[p != eos].tolist()), p[-1] == eos) for p in cut if p.size]


def test_both_paths_read_the_text_in_batches_of_the_same_shape(inputs):
  texts = [open(f, encoding="utf-8").read() for f in inputs.files]
  assert inputs.generated and len(texts) == 4 and sum(map(len, texts)) >= 50_000
  vocabulary = vocab.make_vocabulary(inputs.config.data)
  batches = {}
  for path in bench_data.PATHS:
    reader = bench_data.open_path(path, inputs)
    batches[path] = reader.next_local()
    reader.close()
    assert {k: v.shape for k, v in batches[path].items()} == {k: (ROWS, SEQ_LEN) for k in batches[path]}
  tokenized = batches["tokenized"]
  assert (tokenized["targets"] > 0).all() and (tokenized["loss_weights"] == 1).all()  # rows cut from a stream
  for row in tokenized["targets"]:  # a row lies in one shard, one input file here: a stretch of its lines
    text = "".join(piece + ("\n" if ends else "") for piece, ends in pieces(vocabulary, row))
    assert sum(text in t for t in texts) >= 1, text
  on_the_fly = batches["on_the_fly"]
  for targets_T, segments_T in zip(on_the_fly["targets"], on_the_fly["segment_ids"]):
    for segment in np.unique(segments_T[segments_T > 0]):
      ((piece, ends),) = pieces(vocabulary, targets_T[segments_T == segment])  # one piece of one document
      assert any((piece + "\n" if ends else piece) in t for t in texts), piece


def test_the_table_has_each_path_and_the_bar(inputs, bar):
  timings = [bench_data.time_path(path, inputs, steps=2) for path in bench_data.PATHS]
  assert [t.tokens for t in timings] == [ROWS * SEQ_LEN] * 2
  table = bench_data.format_table(timings, bar).splitlines()
  assert [line.split()[0] for line in table] == ["path", "pre-tokenized", "on", "bar:", "bar:", "pre-tokenized"]
  assert table[0].endswith("x 1 H100  x host of 8")
  for line, t in zip(table[1:3], timings):  # tokens/s, then the multiples of one chip and one host
    rate, per_chip, per_host = (float(line.split()[i].replace(",", "")) for i in (-4, -2, -1))
    assert rate == pytest.approx(t.tokens / t.seconds, abs=1)
    assert per_chip == pytest.approx(t.tokens / t.seconds / bar.per_chip, abs=0.006)
    assert per_host == pytest.approx(t.tokens / t.seconds / bar.per_host, abs=0.006)
  assert table[4].split()[-1] == f"{bar.per_host:,.0f}"
  assert f"one host of 8: {bar.per_host:,.0f} tokens/s" in bench_data.describe(inputs, bar, ROWS, SEQ_LEN, 2)


def test_the_bar_is_the_dry_runs_analytic_projection_on_the_targets_mesh(bar):
  config = bench_data.config_from_file(BAR)
  mesh = state_lib.checked_mesh(config, jax.devices()[:8])  # the mesh the dry run compiles on
  assert targets.mesh_shape(config.mesh, targets.parse("h100x8")) == dict(mesh.shape)
  assert bar.projection == layer_cost.project_step(config, dict(mesh.shape), hardware.CHIPS["h100"])
  assert bar.per_chip == pytest.approx(128 * 2048 / bar.projection.step_overlap_s / 8)
  assert bar.per_host == pytest.approx(8 * bar.per_chip) and bar.host_rows == 128 and bar.seq_len == 2048
  with pytest.raises(config_lib.ConfigError, match="must name a rung on a target"):
    bench_data.training_bar(f"{REPO}/configs/ladder.py:sgatlin,5")
