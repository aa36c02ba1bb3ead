"""sparsetx-bench-data: the store holds the benchmark's text (a row is a stretch of one input file), the raw
tokenizer encodes the documents the job stored, the tables give the tokenize ratio and the read rate against the
bar; the bar is the dry run's analytic projection on the mesh the target builds. No timing is asserted."""

import importlib.util

import jax
import numpy as np
import pytest
from conftest import REPO

from sparsetx import config as config_lib
from sparsetx import hardware
from sparsetx.data import vocab
from sparsetx.plan import step_cost, targets
from sparsetx.tools import bench_data
from sparsetx.train import state as state_lib


def ladder_config(arg: str):
  """configs/ladder.py's get_config(arg), as the --bar flag loads it."""
  spec = importlib.util.spec_from_file_location("ladder_config", f"{REPO}/configs/ladder.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


ROWS, SEQ_LEN = 8, 64


@pytest.fixture(scope="module")
def bar():
  return bench_data.training_bar(ladder_config("sgatlin,5,h100x8"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  work_dir = str(tmp_path_factory.mktemp("bench"))
  return bench_data.prepare(work_dir, megabytes=0.05, vocab_size=300, seq_len=SEQ_LEN, rows=ROWS)


def pieces(vocabulary, tokens) -> list[tuple[str, bool]]:
  """(text, ends its document) of each run of `tokens` between EOS ids (seqio's decode stops at EOS)."""
  eos = vocabulary.eos_id
  cut = np.split(tokens, np.flatnonzero(tokens == eos) + 1)
  return [(vocabulary.decode(p[p != eos].tolist()), p[-1] == eos) for p in cut if p.size]


def test_the_store_holds_the_text_and_reads_in_batches_of_the_bars_shape(inputs):
  texts = [open(f, encoding="utf-8").read() for f in inputs.files]
  assert inputs.generated and len(texts) == 4 and sum(map(len, texts)) >= 50_000
  vocabulary = vocab.make_vocabulary(inputs.config.data)
  reader = bench_data.open_stream(inputs)
  batch = reader.next_local()
  reader.close()
  assert {k: v.shape for k, v in batch.items()} == {k: (ROWS, SEQ_LEN) for k in batch}
  assert (batch["targets"] > 0).all() and (batch["loss_weights"] == 1).all()  # rows cut from a stream
  for row in batch["targets"]:  # a row lies in one shard, one input file here: a stretch of its lines
    text = "".join(piece + ("\n" if ends else "") for piece, ends in pieces(vocabulary, row))
    assert sum(text in t for t in texts) >= 1, text


def test_the_raw_tokenizer_encodes_what_the_job_stored(inputs):
  raw = bench_data.time_encode_batch(inputs)
  documents = bench_data.read_documents(inputs.files)
  lines = [line for f in inputs.files for line in open(f, encoding="utf-8").read().splitlines()]
  assert raw.documents == len(documents) == len(lines) and documents == lines  # no blank lines: every line
  assert raw.tokens + raw.documents == inputs.corpus_tokens  # the same ids, plus one EOS per document
  assert inputs.peak_rss_bytes >= inputs.base_rss_bytes > 0


def test_the_tables_give_the_ratio_and_each_rate_against_the_bar(inputs, bar):
  raw = bench_data.time_encode_batch(inputs)
  table = bench_data.format_tokenize_table(inputs, raw).splitlines()
  job_rate = (inputs.corpus_tokens - raw.documents) / inputs.tokenize_s
  assert table[1].split()[-1] == f"{job_rate:,.0f}" and table[2].split()[-1] == f"{raw.tokens / raw.seconds:,.0f}"
  assert f"tokenize job / encode_batch: {job_rate / (raw.tokens / raw.seconds):.2f} of its tokens/s" in table[3]
  assert table[4].startswith("  peak resident memory of the job (this process): ")
  t = bench_data.time_reads(inputs, steps=2)
  assert t.tokens == ROWS * SEQ_LEN
  table = bench_data.format_read_table(t, bar).splitlines()
  assert [line.split()[0] for line in table] == ["read", "token", "bar:", "bar:"]
  assert table[0].endswith("x 1 H100  x host of 8")
  rate, per_chip, per_host = (float(table[1].split()[i].replace(",", "")) for i in (-4, -2, -1))
  assert rate == pytest.approx(t.tokens / t.seconds, abs=1)
  assert per_chip == pytest.approx(t.tokens / t.seconds / bar.per_chip, abs=0.006)
  assert per_host == pytest.approx(t.tokens / t.seconds / bar.per_host, abs=0.006)
  assert table[3].split()[-1] == f"{bar.per_host:,.0f}"
  assert f"one host of 8: {bar.per_host:,.0f} tokens/s" in bench_data.describe(inputs, bar, ROWS, SEQ_LEN, 2)


def test_the_bar_is_the_dry_runs_analytic_projection_on_the_targets_mesh(bar):
  config = ladder_config("sgatlin,5,h100x8")
  mesh = state_lib.checked_mesh(config, jax.devices()[:8])  # the mesh the dry run compiles on
  assert targets.mesh_shape(config.mesh, targets.parse("h100x8")) == dict(mesh.shape)
  assert bar.projection == step_cost.project_step(config, dict(mesh.shape), hardware.CHIPS["h100"])
  assert bar.per_chip == pytest.approx(128 * 2048 / bar.projection.step_overlap_s / 8)
  assert bar.per_host == pytest.approx(8 * bar.per_chip) and bar.host_rows == 128 and bar.seq_len == 2048
  with pytest.raises(config_lib.ConfigError, match="sized for no machine; give --target"):
    bench_data.training_bar(ladder_config("sgatlin,5"))
  other = bench_data.training_bar(ladder_config("sgatlin,5,v5p-64"))
  assert other.chips_per_host == 4 and other.devices == 32  # a Cloud TPU VM feeds 4 chips
