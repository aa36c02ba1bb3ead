"""sparsetx-tokenize: a tokenized corpus holds every source document exactly once (detokenized shards equal the
text lines, the JSON field values and the embedded corpus, as multisets); an interrupted run finishes on a rerun
with the same shards as an uninterrupted one; a changed config, bad input, a missing or damaged shard are one
clear error; the program's flags and errors."""

import collections
import json
import os
import signal
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest
import seqio
from conftest import REPO

from sparsetx import config as config_lib
from sparsetx.data import corpus, pretokenize, token_store

TEXT = {
  "a.txt": ["The cat sat.", "", "  padded line  ", "naïve café ☕", "   ", "tab\tinside"],
  "b.txt": ["one", "two", "three", "", "four"],
}
VALIDATION = ["held out", "", "also held out"]
RECORDS = [{"body": "json doc"}, {"body": "  "}, {"body": "line\nbreak \"quoted\""}, {"body": "ünïcode"}]


def decoded(corpus_dir, task: str, split: str) -> list[str]:
  """Every document of a task split, detokenized (without its EOS), shard by shard."""
  manifest = token_store.read_manifest(corpus_dir)
  vocabulary = seqio.ByteVocabulary()
  assert manifest["vocabulary"] == {"kind": "byte", "path": "", "vocab_size": 259, "eos_id": vocabulary.eos_id}
  documents = []
  count = manifest["tasks"][task][split]
  for i in range(count):
    shard = token_store.Shard(token_store.split_dir(corpus_dir, task, split) / token_store.shard_name(i, count))
    shard.verify()
    for tokens in shard.documents():
      assert tokens[-1] == vocabulary.eos_id and vocabulary.eos_id not in tokens[:-1]
      documents.append(vocabulary.decode(tokens[:-1].tolist()))
  return documents


def files_config(tmp_path) -> ml_collections.ConfigDict:
  """A text task (two train files, a validation file) and a JSONL task (field `body`, train only)."""
  tmp_path.mkdir()
  for name, lines in TEXT.items():
    (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
  (tmp_path / "val.txt").write_text("\n".join(VALIDATION) + "\n", encoding="utf-8")
  (tmp_path / "web.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
  config = config_lib.default_config()
  config.data.sources.notes = ml_collections.ConfigDict(
    dict(kind="text", train=str(tmp_path / "*.txt").replace("*", "[ab]"), validation=str(tmp_path / "val.txt"))
  )
  config.data.sources.web = ml_collections.ConfigDict(
    dict(kind="jsonl", train=str(tmp_path / "web.jsonl"), text_field="body")
  )
  config.data.mixture = (("notes", 0.5), ("web", 0.5))
  return config


def non_blank(lines):
  return collections.Counter(line for line in lines if line.strip())


@pytest.mark.parametrize("shards", [0, 3])  # 0: one shard per file (whole files); 3: more shards than files
def test_text_and_jsonl_documents_round_trip(tmp_path, shards):
  config = files_config(tmp_path / "src")
  out = tmp_path / "corpus"
  manifest = pretokenize.tokenize_corpus(config, out, workers=1, shards=shards)
  expected_shards = {"notes": {"train": shards or 2, "validation": shards or 1}, "web": {"train": shards or 1}}
  assert manifest["tasks"] == expected_shards
  assert manifest["sources"]["web"] == {"kind": "jsonl", "train": str(tmp_path / "src/web.jsonl"), "text_field": "body"}
  assert collections.Counter(decoded(out, "notes", "train")) == non_blank(TEXT["a.txt"] + TEXT["b.txt"])
  assert collections.Counter(decoded(out, "notes", "validation")) == non_blank(VALIDATION)
  assert collections.Counter(decoded(out, "web", "train")) == non_blank(r["body"] for r in RECORDS)


def test_embedded_corpus_round_trips(tmp_path):
  config = config_lib.default_config()
  config.data.mixture = (("facts", 1.0),)
  pretokenize.tokenize_corpus(config, tmp_path, workers=1, shards=2)
  for split in corpus.SPLITS:
    assert collections.Counter(decoded(tmp_path, "facts", split)) == collections.Counter(corpus.fact_documents(split))


def test_changed_config_bad_input_and_damaged_shards_are_one_clear_error(tmp_path):
  config = files_config(tmp_path / "src")
  out = tmp_path / "corpus"
  pretokenize.tokenize_corpus(config, out, workers=1)
  other = config.copy_and_resolve_references()
  other.data.sources.web.text_field = "title"
  with pytest.raises(config_lib.ConfigError, match=r"holds a corpus tokenized with another config \(task 'web' has"):
    pretokenize.tokenize_corpus(other, out, workers=1)
  plan = json.loads((out / pretokenize.PLAN).read_text())  # as if tokenized with another vocabulary
  (out / pretokenize.PLAN).write_text(json.dumps({**plan, "vocabulary": {"kind": "sentencepiece", "path": "x.model"}}))
  with pytest.raises(config_lib.ConfigError, match="the vocabulary there is .*'sentencepiece'.*--overwrite to replace"):
    pretokenize.tokenize_corpus(config, out, workers=1)
  (out / pretokenize.PLAN).write_text(json.dumps(plan))
  # A task added to the mixture joins the corpus; the others are kept as they are.
  (tmp_path / "src/more.txt").write_text("more\n")
  config.data.sources.more = ml_collections.ConfigDict(dict(kind="text", train=str(tmp_path / "src/more.txt")))
  config.data.mixture = (("notes", 0.5), ("more", 0.5))
  manifest = pretokenize.tokenize_corpus(config, out, workers=1)
  assert manifest["tasks"] == {"notes": {"train": 2, "validation": 1}, "web": {"train": 1}, "more": {"train": 1}}
  assert decoded(out, "more", "train") == ["more"]
  # Other shard counts: refused, unless --overwrite, which replaces the whole corpus.
  with pytest.raises(config_lib.ConfigError, match=r"task 'notes' has shards \{'train': 2, 'validation': 1\} there"):
    pretokenize.tokenize_corpus(config, out, workers=1, shards=3)
  manifest = pretokenize.tokenize_corpus(config, out, workers=1, shards=3, overwrite=True)
  assert manifest["tasks"] == {"notes": {"train": 3, "validation": 3}, "more": {"train": 3}}
  assert sorted(os.listdir(out)) == sorted(["manifest.json", pretokenize.PLAN, "notes", "more"])
  assert sorted(os.listdir(token_store.split_dir(out, "notes", "train"))) == [
    token_store.shard_name(i, 3) for i in range(3)
  ]
  assert collections.Counter(decoded(out, "notes", "train")) == non_blank(TEXT["a.txt"] + TEXT["b.txt"])
  config.data.mixture = (("web", 1.0),)

  (tmp_path / "src/web.jsonl").write_text('{"body": "fine"}\nnot json\n')
  bad = tmp_path / "bad"
  with pytest.raises(
    pretokenize.ShardError, match=r"web/train/shard_00000_of_00001 failed: .*web\.jsonl: line 2 \(byte 17\) is not JSON"
  ):
    pretokenize.tokenize_corpus(config, bad, workers=1)

  split_dir = token_store.split_dir(out, "notes", "train")
  (split_dir / token_store.shard_name(1, 3) / "tokens" / "c" / "0").write_bytes(b"not zstd")
  with pytest.raises(token_store.CorpusError, match=f"shard {split_dir / token_store.shard_name(1, 3)} is damaged"):
    token_store.TokenSplit(out, "notes", "train").shards[1].verify()
  (split_dir / token_store.shard_name(0, 3) / token_store.SHARD_JSON).unlink()
  with pytest.raises(token_store.CorpusError, match=f"shard {split_dir / token_store.shard_name(0, 3)} is missing"):
    token_store.TokenSplit(out, "notes", "train")


def tool(*args: str, **kwargs) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-m", "sparsetx.tools.tokenize", *args],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    **kwargs,
  )


@pytest.mark.long  # a system case of half a minute or more: make test-long
@pytest.mark.slow
def test_interrupted_run_finishes_on_a_rerun_with_the_same_shards(tmp_path):
  """The program, run with two workers and stopped (SIGTERM, a preemption) once its first shard is complete,
  leaves no manifest; the rerun (another worker count) writes the missing shards, and every shard equals the
  uninterrupted run's: no document lost or doubled."""
  rng = np.random.default_rng(0)
  src = tmp_path / "src"
  src.mkdir()
  words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"])
  lines = [" ".join(rng.choice(words, rng.integers(3, 30))) + f" {i}" for i in range(40_000)]
  (src / "big.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
  config_file = tmp_path / "config.py"
  config_file.write_text(
    "import ml_collections\nfrom sparsetx import config as config_lib\n\n\ndef get_config():\n"
    "  config = config_lib.default_config()\n"
    f"  config.data.sources.big = ml_collections.ConfigDict(dict(kind='text', train={str(src / 'big.txt')!r}))\n"
    "  config.data.mixture = (('big', 1.0),)\n  return config\n"
  )
  out = tmp_path / "corpus"
  split_dir = token_store.split_dir(out, "big", "train")
  process = tool(f"--config={config_file}", f"--output_dir={out}", "--workers=2", "--shards=12")
  deadline = time.monotonic() + 240
  while not list(split_dir.glob(f"*/{token_store.SHARD_JSON}")) and process.poll() is None:
    assert time.monotonic() < deadline, "no shard was completed"
    time.sleep(0.02)
  process.send_signal(signal.SIGTERM)
  _, err = process.communicate(timeout=60)
  # One error line. It need not be the last: multiprocessing's resource tracker, a process of its own started
  # with the original stderr, may warn of a queue semaphore after the program has ended (seen once in CI-like runs).
  errors = [line for line in err.splitlines() if line.startswith("error: ")]
  assert process.returncode == 130 and len(errors) == 1, err
  assert errors[0].startswith("error: interrupted; run the same"), err
  assert not (out / token_store.MANIFEST).exists()
  complete = [i for i in range(12) if token_store.shard_complete(split_dir / token_store.shard_name(i, 12))]
  assert 1 <= len(complete) < 12, complete

  def written(i: int) -> int:
    return os.stat(split_dir / token_store.shard_name(i, 12) / token_store.SHARD_JSON).st_mtime_ns

  mtimes = {i: written(i) for i in complete}

  config = config_lib.default_config()
  config.data.sources.big = ml_collections.ConfigDict(dict(kind="text", train=str(src / "big.txt")))
  config.data.mixture = (("big", 1.0),)
  manifest = pretokenize.tokenize_corpus(config, out, workers=1)  # no --shards: the plan's 12 are kept
  assert manifest["tasks"] == {"big": {"train": 12}}
  for i in complete:  # skipped, not rewritten
    assert written(i) == mtimes[i]
  reference = tmp_path / "reference"
  pretokenize.tokenize_corpus(config, reference, workers=1, shards=12)
  assert token_store.TokenSplit(out, "big", "train").sha256 == token_store.TokenSplit(reference, "big", "train").sha256
  assert collections.Counter(decoded(out, "big", "train")) == collections.Counter(lines)


def test_program_flags_and_errors(tmp_path):
  help_text = tool("--help").communicate(timeout=120)[0]
  for flag in ("--config", "--output_dir", "--workers", "--shards", "--overwrite"):
    assert flag in help_text, help_text
  for args, message in [
    ((f"--output_dir={tmp_path}", "--config=configs/nope.py"), "error: --config=configs/nope.py: no such file"),
    (("--config=configs/tiny.py",), "error: --output_dir is required"),
    ((f"--output_dir={tmp_path}", "extra"), "error: unexpected argument 'extra'"),
    ((f"--output_dir={tmp_path}", "--config.data.mixture=(('web', 1.0),)"), "error: config.data.mixture names"),
  ]:
    process = tool(*args)
    _, err = process.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), (args, err)
