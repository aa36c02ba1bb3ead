"""Pre-tokenized corpora: random-access token shards written once by `sparsetx-tokenize`, read by the trainer.

docs/modules.md gives the layout of a tokenized corpus directory (local or a URL such as gs://bucket/corpus).

More: docs/modules.md, sparsetx/data/token_store.py.
"""

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import tensorstore as ts
from etils import epath

from sparsetx import paths
from sparsetx.config import ConfigError

FORMAT = 1
MANIFEST = "manifest.json"
SHARD_JSON = "shard.json"
_CHUNK_TOKENS = 1 << 20  # zarr chunk of `tokens`: 2-4 MiB raw, one compressed object per MiB-scale read
_CHUNK_DOCS = 1 << 16
_END_SAMPLE = 1024  # every 1024th document end is kept in memory to find a row's boundaries in one small read


class CorpusError(ConfigError):  # bad input: one `error:` line and exit 2 in every program
  """A tokenized corpus, split or shard that is missing, incomplete or damaged (the message names it)."""


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(index: int, count: int) -> str:
  return f"shard_{index:05d}_of_{count:05d}"


def split_dir(corpus_dir: epath.PathLike, task: str, split: str) -> epath.Path:
  return paths.resolve(corpus_dir) / task / split


def _kvstore(path: epath.Path) -> str | dict:
  return str(path) if paths.is_remote(path) else {"driver": "file", "path": str(path)}


def _create(path: epath.Path, dtype: np.dtype, chunk: int) -> ts.TensorStore:
  metadata = {
    "shape": [0],
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
    "data_type": dtype.name,
    "codecs": [
      {"name": "bytes", "configuration": {"endian": "little"}},
      {"name": "zstd", "configuration": {"level": 3}},
    ],
  }
  spec = {"driver": "zarr3", "kvstore": _kvstore(path), "metadata": metadata}
  return ts.open(spec, create=True, delete_existing=True).result()


def _open(path: epath.Path) -> ts.TensorStore:
  return ts.open({"driver": "zarr3", "kvstore": _kvstore(path)}, open=True, read=True).result()


class _Appender:
  """Appends to a 1-D zarr array in large writes and hashes what it wrote."""

  def __init__(self, path: epath.Path, dtype: np.dtype, chunk: int):
    self.array, self.dtype, self.chunk = _create(path, dtype, chunk), dtype, chunk
    self.size, self._pending, self._pending_size = 0, [], 0
    self.sha = hashlib.sha256()

  def append(self, values: np.ndarray) -> None:
    self._pending.append(values.astype(self.dtype, copy=False))
    self._pending_size += values.size
    if self._pending_size >= self.chunk:
      self.flush()

  def flush(self) -> None:
    if not self._pending_size:
      return
    values = np.concatenate(self._pending)
    self.array = self.array.resize(exclusive_max=[self.size + values.size], expand_only=True).result()
    self.array[self.size : self.size + values.size].write(values).result()
    self.sha.update(values.tobytes())
    self.size += values.size
    self._pending, self._pending_size = [], 0


def write_shard(path: epath.PathLike, documents: Iterable[np.ndarray], vocab_size: int) -> dict:
  """Writes `documents` (1-D token arrays, in order) as one shard under `path`, replacing whatever is there.

  `shard.json` is removed first and written last, so an interrupted write leaves a shard that
  `shard_complete` reports as incomplete and a rerun rewrites. Returns the shard's JSON record.
  """
  path = paths.resolve(path)
  (path / SHARD_JSON).unlink(missing_ok=True)
  tokens = _Appender(path / "tokens", token_dtype(vocab_size), _CHUNK_TOKENS)
  ends = _Appender(path / "doc_ends", np.dtype(np.int64), _CHUNK_DOCS)
  total = 0
  for document in documents:
    document = np.asarray(document)
    if document.ndim != 1 or not document.size:
      raise ValueError(f"a document for shard {path} is not a non-empty 1-D token array (shape {document.shape}).")
    if document.min() < 0 or document.max() >= vocab_size:
      raise ValueError(f"a document for shard {path} has token ids outside [0, {vocab_size}).")
    tokens.append(document)
    total += document.size
    ends.append(np.array([total], np.int64))
  tokens.flush()
  ends.flush()
  record = dict(
    format=FORMAT,
    n_tokens=tokens.size,
    n_documents=ends.size,
    dtype=tokens.dtype.name,
    sha256=hashlib.sha256(tokens.sha.digest() + ends.sha.digest()).hexdigest(),
  )
  paths.write_text_atomically(path / SHARD_JSON, json.dumps(record, indent=1, sort_keys=True))
  return record


def shard_complete(path: epath.PathLike) -> bool:
  """Whether a shard was written to the end (its shard.json exists and is readable)."""
  try:
    return json.loads((paths.resolve(path) / SHARD_JSON).read_text()).get("format") == FORMAT
  except (OSError, ValueError):
    return False


class Shard:
  """One complete shard, opened for random reads."""

  def __init__(self, path: epath.PathLike):
    self.path = paths.resolve(path)
    try:
      self.record = json.loads((self.path / SHARD_JSON).read_text())
    except FileNotFoundError:
      raise CorpusError(
        f"shard {self.path} is missing or incomplete (no {SHARD_JSON}); run sparsetx-tokenize again to finish it."
      ) from None
    except (OSError, ValueError) as error:
      raise CorpusError(f"shard {self.path} has an unreadable {SHARD_JSON} ({paths.reason(error)}).") from None
    try:
      self._tokens, self._ends = _open(self.path / "tokens"), _open(self.path / "doc_ends")
    except ValueError as error:
      raise self.damaged(error) from None
    self.n_tokens, self.n_documents = int(self.record["n_tokens"]), int(self.record["n_documents"])
    if self._tokens.shape != (self.n_tokens,) or self._ends.shape != (self.n_documents,):
      raise CorpusError(
        f"shard {self.path} holds {self._tokens.shape[0]} tokens and {self._ends.shape[0]} documents, but its "
        f"{SHARD_JSON} says {self.n_tokens} and {self.n_documents}; delete it and run sparsetx-tokenize again."
      )
    self._end_sample = self._ends[::_END_SAMPLE].read().result() if self.n_documents else np.zeros(0, np.int64)

  @property
  def sha256(self) -> str:
    return self.record["sha256"]

  def read_tokens(self, start: int, stop: int) -> ts.Future:
    """A future of tokens [start, stop) (the array's dtype)."""
    return self._tokens[start:stop].read()

  def read_boundaries(self, start: int, stop: int) -> "Boundaries":
    """The offsets e with start < e < stop where a document ends and the next begins: one small read, started
    now (`.result()` waits for it), so the reads of many rows overlap."""
    lo = max(int(np.searchsorted(self._end_sample, start, side="right")) - 1, 0) * _END_SAMPLE
    hi = min(int(np.searchsorted(self._end_sample, stop, side="left")) * _END_SAMPLE + 1, self.n_documents)
    return Boundaries(self._ends[lo:hi].read() if hi > lo else None, start, stop)

  def documents(self) -> Iterator[np.ndarray]:
    """Every document, in order (for detokenizing and checks; reads the shard whole)."""
    if not self.n_documents:  # a shard of a split with fewer documents than shards
      return iter(())
    tokens, ends = self._tokens.read().result(), self._ends.read().result()
    return iter(np.split(tokens, ends[:-1]))

  def damaged(self, error: Exception) -> CorpusError:
    return CorpusError(
      f"shard {self.path} is damaged ({paths.reason(error)}); delete it and run sparsetx-tokenize again."
    )

  def verify(self) -> None:
    """Reads both arrays whole and checks them against the sha256 recorded at write time."""
    try:
      tokens, ends = self._tokens.read().result(), self._ends.read().result()
    except ValueError as error:
      raise self.damaged(error) from None
    digest = hashlib.sha256(hashlib.sha256(tokens.tobytes()).digest() + hashlib.sha256(ends.tobytes()).digest())
    if digest.hexdigest() != self.sha256 or (self.n_documents and ends[-1] != self.n_tokens):
      raise self.damaged(ValueError("its contents fail their checksum"))


@dataclasses.dataclass
class Boundaries:
  """A pending read of document ends around [start, stop)."""

  future: ts.Future | None
  start: int
  stop: int

  def result(self) -> np.ndarray:
    ends = self.future.result() if self.future is not None else np.zeros(0, np.int64)
    return ends[(ends > self.start) & (ends < self.stop)]


@dataclasses.dataclass
class Rows:
  """Rows of `seq_len` tokens cut from a split's token stream, with where each document starts."""

  tokens_NT: np.ndarray  # int32
  starts_NT: np.ndarray  # bool: a document (or the row's first piece of one) begins at this token


class TokenSplit:
  """A task's split: its shards end to end. Row r of length T is the r-th T-token slice of the shards, each
  shard giving floor(n_tokens / T) rows (a shard's last < T tokens are left out, so no row spans two shards)."""

  def __init__(self, corpus_dir: epath.PathLike, task: str, split: str):
    directory = split_dir(corpus_dir, task, split)
    count = read_manifest(corpus_dir)["tasks"].get(task, {}).get(split)
    if count is None:
      raise CorpusError(
        f"the tokenized corpus {paths.resolve(corpus_dir)} has no split {split!r} of task {task!r}; "
        "run sparsetx-tokenize with the same config.data.mixture to add it."
      )
    self.shards = [Shard(directory / shard_name(i, count)) for i in range(count)]
    self.n_tokens = sum(shard.n_tokens for shard in self.shards)
    self.sha256 = hashlib.sha256("".join(shard.sha256 for shard in self.shards).encode()).hexdigest()

  def row_count(self, seq_len: int) -> int:
    return sum(shard.n_tokens // seq_len for shard in self.shards)

  def rows(self, row_ids: Sequence[int], seq_len: int) -> Rows:
    """Rows `row_ids` (any order, repeats allowed), read concurrently."""
    per_shard = np.array([shard.n_tokens // seq_len for shard in self.shards])
    first_row = np.concatenate([[0], np.cumsum(per_shard)])
    row_ids = np.asarray(row_ids, np.int64)
    if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= first_row[-1]):
      raise IndexError(f"row ids must lie in [0, {first_row[-1]}) for seq_len={seq_len}.")
    which = np.searchsorted(first_row, row_ids, side="right") - 1
    starts = (row_ids - first_row[which]) * seq_len
    futures = [self.shards[s].read_tokens(a, a + seq_len) for s, a in zip(which, starts)]
    ends = [self.shards[s].read_boundaries(a, a + seq_len) for s, a in zip(which, starts)]  # all in flight
    starts_NT = np.zeros((row_ids.size, seq_len), bool)
    starts_NT[:, 0] = True
    for n, (s, a) in enumerate(zip(which, starts)):
      try:
        starts_NT[n, ends[n].result() - a] = True
      except ValueError as error:
        raise self.shards[s].damaged(error) from None
    tokens_NT = np.zeros((row_ids.size, seq_len), np.int32)
    for n, (s, future) in enumerate(zip(which, futures)):
      try:
        tokens_NT[n] = future.result()
      except ValueError as error:
        raise self.shards[s].damaged(error) from None
    return Rows(tokens_NT, starts_NT)


def write_manifest(
  corpus_dir: epath.PathLike, vocabulary: dict, tasks: dict[str, dict[str, int]], sources: dict | None = None
) -> None:
  """Writes manifest.json: the vocabulary the shards were tokenized with, each task's shard count per split and
  its source (the JSON view of config.data.sources.<task>; {} for the embedded corpus)."""
  record = dict(format=FORMAT, vocabulary=vocabulary, tasks=tasks, sources=sources or {})
  paths.write_text_atomically(paths.resolve(corpus_dir) / MANIFEST, json.dumps(record, indent=1, sort_keys=True))


def read_manifest(corpus_dir: epath.PathLike) -> dict:
  path = paths.resolve(corpus_dir) / MANIFEST
  try:
    record = json.loads(path.read_text())
  except FileNotFoundError:
    raise CorpusError(
      f"{path} does not exist: {paths.resolve(corpus_dir)} is not a finished tokenized corpus; "
      "run sparsetx-tokenize to write (or finish) it."
    ) from None
  except (OSError, ValueError) as error:
    raise CorpusError(f"{path} is unreadable ({paths.reason(error)}); run sparsetx-tokenize again.") from None
  if record.get("format") != FORMAT:
    raise CorpusError(f"{path} has format {record.get('format')!r}; this code reads {FORMAT}: tokenize again.")
  return record
