"""Corpora as they ship (sparsetx/data/documents.py): parquet files, JSON lines plain, .gz and .zst, and `datasets`
folders tokenize into a corpus whose documents equal the source texts (as multisets: none lost or doubled); a bad
file is one error naming the file and the row or byte offset, shards already written stay valid, and the same
command finishes the corpus once the file is fixed; the trainer tokenizes these sources into its workdir."""

import collections
import gzip
import json
import re
import zlib

import datasets
import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import load_config
from test_tokenize import decoded

from sparsetx import config as config_lib
from sparsetx.data import documents, file_checks, pretokenize, token_store
from sparsetx.train.run import loop

DOCS = [f"document {i}: naïve café ☕ {'x' * (i % 7)}" for i in range(40)] + ["line\nbreak \"quoted\"", "  "]


def non_blank(texts):
  return collections.Counter(t for t in texts if t.strip())


def write_parquet(path, texts, row_group_size=7, field="text"):
  pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), path, row_group_size=row_group_size)


def jsonl_bytes(texts, field="text"):
  return "".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)).encode()


def write_zst(path, texts, frames=2):
  """A .zst file of `frames` concatenated frames (as pzstd and Dolma's writers make)."""
  data = jsonl_bytes(texts)
  cut = len(data) // frames
  parts = [data[i * cut : (i + 1) * cut if i < frames - 1 else None] for i in range(frames)]
  path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(p) for p in parts))


def source_config(kind, train, field="text"):
  config = config_lib.default_config()
  config.data.sources.web = ml_collections.ConfigDict(dict(kind=kind, train=train, text_field=field))
  config.data.mixture = (("web", 1.0),)
  return config


@pytest.mark.parametrize("kind", ["parquet", "jsonl.zst", "jsonl.gz", "datasets"])
def test_each_format_tokenizes_every_document_once(tmp_path, kind):
  src = tmp_path / "src"
  src.mkdir()
  halves = (DOCS[:25], DOCS[25:])
  if kind == "parquet":
    for i, half in enumerate(halves):
      write_parquet(src / f"part-{i}.parquet", half)
    train = str(src / "*.parquet")
  elif kind == "jsonl.zst":
    for i, half in enumerate(halves):
      write_zst(src / f"part-{i}.jsonl.zst", half)
    train = str(src / "*.jsonl.zst")
  elif kind == "jsonl.gz":
    for i, half in enumerate(halves):
      (src / f"part-{i}.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(half)))
    train = str(src / "*.jsonl.gz")
  else:
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(src / "saved"), num_shards=2)
    train = str(src / "saved")
  config = source_config(kind.split(".")[0], train)
  file_checks.check_files(config)
  manifest = pretokenize.tokenize_corpus(config, tmp_path / "corpus", workers=1)
  assert manifest["tasks"]["web"] == {"train": 2}  # one shard per file
  assert collections.Counter(decoded(tmp_path / "corpus", "web", "train")) == non_blank(DOCS)


def test_streaming_readers_read_what_the_files_hold(tmp_path):
  write_parquet(tmp_path / "a.parquet", DOCS, row_group_size=5)
  write_zst(tmp_path / "a.jsonl.zst", DOCS, frames=3)
  (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(DOCS))
  assert list(documents.parquet_documents(str(tmp_path / "a.parquet"))) == DOCS
  assert list(documents.jsonl_documents(str(tmp_path / "a.jsonl.zst"))) == DOCS
  assert list(documents.jsonl_documents(str(tmp_path / "a.jsonl"))) == DOCS


def bad_files(tmp_path):
  """{name: (path, field, the message's pattern)} of each kind of bad input."""
  write_parquet(tmp_path / "good.parquet", DOCS)
  damaged = (tmp_path / "good.parquet").read_bytes()
  (tmp_path / "damaged.parquet").write_bytes(damaged[: len(damaged) // 2])
  write_parquet(tmp_path / "title.parquet", DOCS, field="title")
  whole_gz = gzip.compress(jsonl_bytes(DOCS))
  (tmp_path / "cut.jsonl.gz").write_bytes(whole_gz[: len(whole_gz) // 2])
  write_zst(tmp_path / "whole.jsonl.zst", DOCS, frames=1)
  whole_zst = (tmp_path / "whole.jsonl.zst").read_bytes()
  (tmp_path / "cut.jsonl.zst").write_bytes(whole_zst[: len(whole_zst) // 2])
  (tmp_path / "notjson.jsonl").write_bytes(b'{"text": "fine"}\nnot json\n')
  (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
  return {
    "damaged parquet": (tmp_path / "damaged.parquet", "text", r"damaged\.parquet is not a readable parquet file"),
    "missing column": (tmp_path / "title.parquet", "text", r"title\.parquet has no column 'text' \(it has title, id\)"),
    "truncated gz": (tmp_path / "cut.jsonl.gz", "text", r"cut\.jsonl\.gz: the compressed stream breaks after byte \d+"),
    "truncated zst": (tmp_path / "cut.jsonl.zst", "text", r"cut\.jsonl\.zst: the compressed stream breaks after byte"),
    "not json": (tmp_path / "notjson.jsonl", "text", r"notjson\.jsonl: line 2 \(byte 17\) is not JSON"),
    "not utf-8": (tmp_path / "latin1.jsonl", "text", r"latin1\.jsonl: line 2 \(byte 17\) is not UTF-8"),
    "missing field": (tmp_path / "notjson.jsonl", "body", r"notjson\.jsonl: line 1 \(byte 0\) has no string field"),
  }


def test_bad_input_is_one_error_naming_the_file_and_where(tmp_path):
  for name, (path, field, pattern) in bad_files(tmp_path).items():
    read = documents.parquet_documents if path.suffix == ".parquet" else documents.jsonl_documents
    with pytest.raises(documents.DocumentError, match=pattern):
      list(read(str(path), field))
    assert "\n" not in str(pytest.raises(documents.DocumentError, lambda: list(read(str(path), field))).value), name


def test_a_bad_file_stops_its_shard_keeps_the_others_and_the_rerun_finishes(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  write_zst(src / "a.jsonl.zst", DOCS[:25])
  whole = gzip.compress(jsonl_bytes(DOCS[25:]))
  (src / "b.jsonl.gz").write_bytes(whole[: len(whole) // 2])
  config = source_config("jsonl", (str(src / "a.jsonl.zst"), str(src / "b.jsonl.gz")))
  out, progress = tmp_path / "corpus", []
  with pytest.raises(
    pretokenize.ShardError, match=r"web/train/shard_00001_of_00002 failed: .*b\.jsonl\.gz: the compressed"
  ):
    pretokenize.tokenize_corpus(config, out, workers=1)
  assert not (out / "manifest.json").exists()
  first = token_store.split_dir(out, "web", "train") / token_store.shard_name(0, 2)
  assert token_store.shard_complete(first)
  (src / "b.jsonl.gz").write_bytes(whole)  # the file fixed: the same command finishes the corpus
  pretokenize.tokenize_corpus(config, out, workers=1, progress=lambda p: progress.append(p))
  assert progress[-1].shards_skipped == 1  # the complete shard was kept
  assert collections.Counter(decoded(out, "web", "train")) == non_blank(DOCS)


def test_the_trainer_tokenizes_these_sources_into_its_workdir_and_trains_on_them(tmp_path):
  """A mixture of a parquet directory, a .jsonl.zst directory and a datasets folder, given to the trainer as
  sources: it writes their corpus into <workdir>/tokenized (every document once) and trains from it."""
  src = tmp_path / "src"
  (src / "parquet").mkdir(parents=True)
  (src / "zst").mkdir()
  for i, half in enumerate((DOCS[:25], DOCS[25:])):
    write_parquet(src / "parquet" / f"part-{i}.parquet", half)
    write_zst(src / "zst" / f"part-{i}.jsonl.zst", half)
  datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(src / "saved"))
  config = load_config("configs/tiny.py", "mlp")
  config.model.update(d_model=32, n_layers=1, head_dim=16, max_len=16, dtype="float32")
  config.model.ffn.d_ffw = 64
  config.data.update(seq_len=16, global_batch_size=8, eval_batch_size=8)
  config.data.sources = ml_collections.ConfigDict(
    dict(
      pq=dict(kind="parquet", train=str(src / "parquet" / "*.parquet")),
      zst=dict(kind="jsonl", train=str(src / "zst" / "*.jsonl.zst")),
      saved=dict(kind="datasets", train=str(src / "saved")),
    )
  )
  config.data.mixture = (("pq", 1.0), ("zst", 1.0), ("saved", 1.0))
  config.train.update(steps=2, warmup_steps=1, log_every=1, eval_every=1000)
  metrics = loop.train(config, str(tmp_path / "run"))
  assert np.isfinite(metrics["loss"])
  corpus = tmp_path / "run" / pretokenize.WORKDIR_CORPUS
  for task in ("pq", "zst", "saved"):
    assert collections.Counter(decoded(corpus, task, "train")) == non_blank(DOCS), task


def test_a_datasets_dict_folder_names_the_split_folder(tmp_path):
  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(tmp_path / "dict"))
  config = source_config("datasets", str(tmp_path / "dict"))
  with pytest.raises(
    config_lib.ConfigError, match=r"holds a DatasetDict: point at one split's folder, e\.g\. .*dict/train"
  ):
    file_checks.check_files(config)


def test_the_trainer_ends_bad_data_in_one_line_naming_the_place(tmp_path, capsys):
  """sparsetx-train on each bad corpus file a user meets: one `error:` line naming the file and the place, exit 2."""
  from types import SimpleNamespace  # noqa: PLC0415

  from sparsetx.tools import train as train_tool  # noqa: PLC0415

  good = jsonl_bytes(DOCS)
  gz = gzip.compress(good)
  cut = gz[: int(len(gz) * 0.6)]
  readable = len(zlib.decompressobj(zlib.MAX_WBITS | 16).decompress(cut))  # the text before the break
  lines = good.splitlines(keepends=True)
  cases = {
    "short.jsonl": (good[:-9], rf"short\.jsonl: line {len(DOCS)} \(byte {len(good) - len(lines[-1])}\) is not JSON"),
    "torn.jsonl": (
      b"".join(lines[:3]) + lines[3][:20] + b"\n" + b"".join(lines[4:]),
      rf"torn\.jsonl: line 4 \(byte {len(b''.join(lines[:3]))}\) is not JSON",
    ),
    "cut.jsonl.gz": (cut, rf"cut\.jsonl\.gz: the compressed stream breaks after byte {readable} of its text"),
    "plain.jsonl.gz": (good, r"plain\.jsonl\.gz is not gzip-compressed, as its suffix says"),
  }
  assert 0 < readable < len(good)
  for name, (content, pattern) in cases.items():
    (tmp_path / name).write_bytes(content)
    config = source_config("jsonl", str(tmp_path / name))
    config.data.seq_len = config.model.max_len = 32
    flags = dict(config=config, workdir=str(tmp_path / f"run_{name}"), local_device_ids=None, distributed_timeout=30)
    flags.update(coordinator_address=None, num_processes=None, process_id=None, heartbeat_timeout=10)
    with pytest.raises(SystemExit) as exit_info:
      train_tool.absl_main(None, {k: SimpleNamespace(value=v) for k, v in flags.items()})
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, (name, errors)
    assert re.search(pattern, errors[0]) and "then run the same command again" in errors[0], (name, errors[0])
