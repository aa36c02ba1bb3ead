"""The deterministic global stream over a tokenized corpus (token_store): the batch of step s is a pure function
of (the data config, its seed, s), never of the number of processes or devices.

Step s (0-based: the batch that trains step s + 1) holds B = config.data.global_batch_size rows of T = seq_len
tokens; docs/modules.md says how they are drawn.

More: docs/modules.md, sparsetx/data/global_stream.py.
"""

import concurrent.futures
import fractions
import functools
import hashlib
import json
import math

import jax
import ml_collections
import numpy as np
from absl import logging

from sparsetx import config as config_lib
from sparsetx.data import batches, packing, token_store

STATE_FORMAT = 1
_ROUNDS = 6
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# ---------------------------------------------------------------------------------------------------------------
# Permutations


def _key(*parts) -> int:
  """A 64-bit key from any JSON-able parts (sha256: stable across machines and Python versions)."""
  return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little")


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer on uint64 (wrapping arithmetic)."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


class Permutation:
  """A keyed bijection of [0, size): a balanced Feistel network on 2h bits (4^h < 4 * size) with cycle walking
  (values >= size are permuted again until they land inside), so it needs no table for any size."""

  def __init__(self, size: int, key: int):
    if size < 1:
      raise ValueError(f"a permutation needs a size >= 1, not {size}.")
    self.size = size
    self._half = max(1, math.ceil(math.ceil(math.log2(size)) / 2)) if size > 1 else 1
    self._round_keys = [np.uint64(_key(key, r)) for r in range(_ROUNDS)]

  def _feistel(self, x: np.ndarray) -> np.ndarray:
    half = np.uint64(self._half)
    low_mask = np.uint64((1 << self._half) - 1)
    left, right = x >> half, x & low_mask
    for round_key in self._round_keys:
      left, right = right, left ^ (_mix(right ^ round_key) & low_mask)
    return (left << half) | right

  def __call__(self, index) -> np.ndarray:
    x = np.asarray(index, np.uint64).copy()
    if x.size and (x.max() >= self.size):
      raise IndexError(f"indices must lie in [0, {self.size}).")
    outside = np.ones(x.shape, bool)
    with np.errstate(over="ignore"):
      while outside.any():  # expected < 4 rounds of walking: the domain is under 4x the size
        x[outside] = self._feistel(x[outside])
        outside = x >= self.size
    return x.astype(np.int64)


# ---------------------------------------------------------------------------------------------------------------
# Mixture apportionment


class Apportionment:
  """C_t(n): rows of task t among the first n rows of the stream, by largest remainder on the exact rates
  (ties to the earlier task): within one row of n * rate_t / sum(rates) for every n."""

  def __init__(self, rates):
    self.rates = [fractions.Fraction(float(r)) for r in rates]
    if not self.rates or min(self.rates) <= 0:
      raise config_lib.ConfigError(f"config.data.mixture rates {list(map(float, rates))} must all be positive.")
    self._total = sum(self.rates)

  def counts(self, n: int) -> tuple[int, ...]:
    quotas = [n * r / self._total for r in self.rates]
    counts = [q.numerator // q.denominator for q in quotas]
    remainders = sorted(range(len(quotas)), key=lambda t: (-(quotas[t] - counts[t]), t))
    for t in remainders[: n - sum(counts)]:
      counts[t] += 1
    return tuple(counts)

  def group_steps(self, batch: int) -> int:
    """The fewest steps G in which every task has at least one row: largest remainder is monotone over groups of
    G steps (G * batch * share >= 1 for every task), so no task's count drops from one group to the next (the
    Alabama paradox needs a task with less than one row per group)."""
    return max(math.ceil(self._total / (batch * r)) for r in self.rates)


# ---------------------------------------------------------------------------------------------------------------
# The stream


def check_vocabulary(config: ml_collections.ConfigDict, manifest: dict, corpus_dir: str) -> dict:
  """The corpus's vocabulary record, refused in one sentence when it is not the config's."""
  from sparsetx.data import vocab  # loads the tokenizer files once (not on the hot path)

  vocabulary = vocab.make_vocabulary(config.data, config.model.vocab_size)
  wanted = dict(
    kind=config.data.vocab.kind,
    path=config.data.vocab.path,
    vocab_size=int(vocabulary.vocab_size),
    eos_id=int(vocabulary.eos_id),
  )
  saved = manifest.get("vocabulary", {})
  if {k: saved.get(k) for k in wanted} != wanted:
    raise config_lib.ConfigError(
      f"config.data.tokenized_dir={corpus_dir!r} was tokenized with vocabulary {json.dumps(saved, sort_keys=True)}, "
      f"but config.data.vocab gives {json.dumps(wanted, sort_keys=True)}; tokenize again with this vocabulary, or "
      "set config.data.vocab to the corpus's."
    )
  return saved


def stream_fields(config: ml_collections.ConfigDict, vocabulary: dict, split_sha256: dict) -> dict:
  """What fixes the stream, as JSON: the fingerprint is its sha256."""
  data = config.data
  return json.loads(
    json.dumps(
      dict(
        mixture=[[name, float(rate)] for name, rate in data.mixture],
        seq_len=data.seq_len,
        global_batch_size=data.global_batch_size,
        seed=data.seed,
        vocabulary=vocabulary,
        corpus_sha256=split_sha256,
      ),
      sort_keys=True,
    )
  )


def fingerprint(fields: dict) -> str:
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _require_packing(config: ml_collections.ConfigDict) -> None:
  if not config.data.pack:
    raise config_lib.ConfigError(
      "config.data.pack=False, but a tokenized corpus (config.data.tokenized_dir) is read as packed rows; "
      "set config.data.pack=True or config.data.tokenized_dir=''."
    )


class GlobalStream:
  """Yields global train batches (dicts of jax.Arrays [B, T]); `save(path)` / `restore(path)` keep its step."""

  def __init__(self, config: ml_collections.ConfigDict, batch_sharding: jax.sharding.Sharding, step: int = 0, skip=()):
    """`skip`: (START, END) windows of 1-based steps (config.data.skip_steps and the workdir's record) whose
    batches are never yielded: iteration steps over them, the mapping of step to batch stays as it is."""
    _require_packing(config)
    data = config.data
    self._sharding, self.global_rows, self.seq_len = batch_sharding, data.global_batch_size, data.seq_len
    self._accept_new = data.accept_new_stream
    self.corpus_dir = data.tokenized_dir
    manifest = token_store.read_manifest(self.corpus_dir)
    vocabulary = check_vocabulary(config, manifest, self.corpus_dir)
    self.tasks = [name for name, _ in data.mixture]
    self.splits = [token_store.TokenSplit(self.corpus_dir, name, "train") for name in self.tasks]
    self.row_counts = [split.row_count(self.seq_len) for split in self.splits]
    for name, split, rows in zip(self.tasks, self.splits, self.row_counts):
      if not rows:
        raise token_store.CorpusError(
          f"task {name!r} of config.data.tokenized_dir={self.corpus_dir!r} has {split.n_tokens} train tokens, "
          f"no shard with a whole row of config.data.seq_len={self.seq_len}; tokenize more data or use a shorter "
          "seq_len."
        )
    self.apportionment = Apportionment([rate for _, rate in data.mixture])
    self.group_steps = self.apportionment.group_steps(self.global_rows)
    self.fields = stream_fields(config, vocabulary, {n: s.sha256 for n, s in zip(self.tasks, self.splits)})
    self.fingerprint = fingerprint(self.fields)
    shard_info, self.local_rows = batches.data_shard(batch_sharding, self.global_rows)
    self.first_row = shard_info.index * self.local_rows
    self.step = step  # the next step to yield (0-based): batches yielded or skipped since the stream's start
    self.skip = tuple(skip)
    self._seed = data.seed
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="global_stream")
    self._pending = None  # (step, future of its local rows)

  # The mapping: pure functions of (config, seed, step).

  def batch_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(task index, row id in its train split) of each of the step's B rows, in batch order."""
    group, j = divmod(step, self.group_steps)
    size = self.group_steps * self.global_rows
    before = np.array(self.apportionment.counts(group * size), np.int64)
    sizes = np.array(self.apportionment.counts((group + 1) * size), np.int64) - before
    ends = np.cumsum(sizes)
    order = Permutation(size, _key("order", self._seed, group))  # the group's rows, tasks in mixture order, shuffled
    position_B = order(np.arange(j * self.global_rows, (j + 1) * self.global_rows))
    task_B = np.searchsorted(ends, position_B, side="right")
    k_B = before[task_B] + position_B - (ends - sizes)[task_B]  # the task's row number in the whole stream
    row_B = np.empty_like(k_B)
    for t in np.unique(task_B):
      chosen = task_B == t
      epochs, positions = np.divmod(k_B[chosen], self.row_counts[t])
      rows = np.empty_like(positions)
      for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        rows[in_epoch] = self._row_permutation(int(t), int(epoch))(positions[in_epoch])
      row_B[chosen] = rows
    return task_B, row_B

  @functools.lru_cache(maxsize=32)  # noqa: B019  (one stream per run; a handful of live (task, epoch) keys)
  def _row_permutation(self, task: int, epoch: int) -> Permutation:
    return Permutation(self.row_counts[task], _key("rows", self._seed, self.tasks[task], epoch))

  def read_rows(self, step: int, first: int, count: int) -> dict[str, np.ndarray]:
    """Packed features of rows [first, first + count) of the step's batch (numpy, [count, T])."""
    task_B, row_B = self.batch_rows(step)
    task_N, row_N = task_B[first : first + count], row_B[first : first + count]
    tokens_NT = np.zeros((count, self.seq_len), np.int32)
    starts_NT = np.zeros((count, self.seq_len), bool)
    for t in np.unique(task_N):
      chosen = task_N == t
      rows = self.splits[t].rows(row_N[chosen], self.seq_len)
      tokens_NT[chosen], starts_NT[chosen] = rows.tokens_NT, rows.starts_NT
    return packing.packed_features(token_store.Rows(tokens_NT, starts_NT))

  # Iteration, one step read ahead.

  def _submit(self, step: int) -> None:
    self._pending = step, self._executor.submit(self.read_rows, step, self.first_row, self.local_rows)

  def unskipped(self, step: int) -> int:
    """The first 0-based step >= `step` outside the skipped windows."""
    for start, end in self.skip:
      if start - 1 <= step <= end - 1:
        step = end
    return step

  def next_local(self) -> dict[str, np.ndarray]:
    """This process's rows of the next batch, as numpy (what `__next__` makes global); `step - 1` is its step."""
    self.step = self.unskipped(self.step)
    if self._pending is None or self._pending[0] != self.step:
      self._submit(self.step)
    local = self._pending[1].result()
    self.step += 1
    self._submit(self.unskipped(self.step))  # read while the devices run this step
    return local

  def __iter__(self) -> "GlobalStream":
    return self

  def __next__(self) -> dict[str, jax.Array]:
    return batches.global_batch(self.next_local(), self._sharding, self.global_rows)

  def close(self) -> None:
    self._pending = None
    self._executor.shutdown(wait=True, cancel_futures=True)

  # State: an item of the same checkpoint step (train/checkpoints/checkpointing.py).

  def state(self) -> dict:
    """The stream's position, as JSON: the next step and the fingerprint of what fixes the stream."""
    return dict(format=STATE_FORMAT, step=self.step, fingerprint=self.fingerprint, fields=self.fields)

  def restore(self, state: dict, where: str) -> None:
    """Continues at the saved step (`state` from a checkpoint at `where`, checked by `check_state`). A state of
    another stream (fingerprint) is a ConfigError naming what changed, unless config.data.accept_new_stream: then
    this config's stream continues at the saved step."""
    if state["fingerprint"] != self.fingerprint:
      change = changed_fields(state["fields"], self.fields)
      if not self._accept_new:
        raise config_lib.ConfigError(
          f"the data state of {where} (step {state['step']}) was saved with {change}; resume with the same data "
          "config and corpus, or set config.data.accept_new_stream=True to continue this config's stream at that "
          "step."
        )
      logging.warning(
        "The data state of %s was saved with %s; config.data.accept_new_stream: continuing this config's stream "
        "at step %d.",
        where,
        change,
        state["step"],
      )
    self.seek(int(state["step"]))

  def seek(self, step: int) -> None:
    """Continues at 0-based `step` (its batch, or the first after it outside the skipped windows)."""
    self.step = step
    self._pending = None


def changed_fields(saved: dict, current: dict) -> str:
  """'config.data.seed=1 (now 2)', or the corpus part that changed."""
  names = dict(vocabulary="the tokenized corpus's vocabulary", corpus_sha256="the tokenized corpus's train shards")
  changes = []
  for key in sorted(set(saved) | set(current)):
    if saved.get(key) == current.get(key):
      continue
    if key in names:
      changes.append(f"{names[key]} {json.dumps(saved.get(key))} (now {json.dumps(current.get(key))})")
    else:
      changes.append(f"config.data.{key}={json.dumps(saved.get(key))} (now {json.dumps(current.get(key))})")
  return ", ".join(changes) or "another fingerprint"


def check_state(state) -> dict:
  """A saved stream state, checked; ValueError saying what is wrong with it."""
  if not isinstance(state, dict):
    raise ValueError(f"its data state is not a JSON object ({type(state).__name__})")
  if state.get("format") != STATE_FORMAT:
    raise ValueError(f"its data state has format {state.get('format')!r}; this code reads {STATE_FORMAT}")
  try:
    state = dict(state, step=int(state["step"]))
  except (KeyError, TypeError, ValueError):
    raise ValueError("its data state has no integer step") from None
  if not isinstance(state.get("fingerprint"), str) or not isinstance(state.get("fields"), dict):
    raise ValueError("its data state's fingerprint or fields are missing or of the wrong type")
  return state


# ---------------------------------------------------------------------------------------------------------------
# Evaluation


class TokenizedEvalData:
  """The validation splits of the mixture's tasks in a tokenized corpus: one ordered pass each (no tokenizer).

  Global batch b of a split holds its rows [bB, (b+1)B); rows past the split's end are padding (loss weight 0),
  so every process yields the same number of batches, ceil(rows / B), with no collective. A shard's last
  < seq_len tokens are left out, as in training."""

  def __init__(
    self, config: ml_collections.ConfigDict, batch_sharding: jax.sharding.Sharding, split="validation", required=True
  ):
    """`required` False: a corpus without the split gives no batches (training without evaluation)."""
    _require_packing(config)
    data = config.data
    self._sharding, self._global_rows, self._seq_len = batch_sharding, data.eval_batch_size, data.seq_len
    manifest = token_store.read_manifest(data.tokenized_dir)
    check_vocabulary(config, manifest, data.tokenized_dir)
    absent = [name for name, _ in data.mixture if name not in manifest["tasks"]]
    if absent:
      raise config_lib.ConfigError(
        f"task {absent[0]!r} is not in config.data.tokenized_dir={data.tokenized_dir!r} (it holds "
        f"{', '.join(manifest['tasks'])}); tokenize it there with sparsetx-tokenize, or leave it out."
      )
    names = [name for name, _ in data.mixture if split in manifest["tasks"][name]]
    if not names and required:
      raise config_lib.ConfigError(
        f"no task of config.data.mixture has a {split!r} split in config.data.tokenized_dir={data.tokenized_dir!r}; "
        "tokenize one (config.data.sources.<name>.validation), or evaluate another split."
      )
    self.splits = {name: token_store.TokenSplit(data.tokenized_dir, name, split) for name in names}
    shard_info, self._local_rows = batches.data_shard(batch_sharding, self._global_rows)
    self._first = shard_info.index * self._local_rows

  @property
  def task_names(self) -> list[str]:
    return list(self.splits)

  def local_batch(self, name: str, index: int) -> dict[str, np.ndarray]:
    split = self.splits[name]
    count = split.row_count(self._seq_len)
    ids = np.arange(self._local_rows) + index * self._global_rows + self._first
    real = ids < count
    features = packing.packed_features(split.rows(ids[real], self._seq_len))
    return {k: np.concatenate([v, np.zeros((int((~real).sum()), self._seq_len), v.dtype)]) for k, v in features.items()}

  def local_batches(self, name: str):
    """This process's rows of each batch of task `name`, as numpy."""
    count = self.splits[name].row_count(self._seq_len)
    for index in range(-(-count // self._global_rows)):
      yield self.local_batch(name, index)

  def task_iterator(self, name: str):
    for local in self.local_batches(name):
      yield batches.global_batch(local, self._sharding, self._global_rows)

  def __iter__(self):
    for name in self.splits:
      yield from self.task_iterator(name)
