"""Per-process input pipeline: seqio mixture -> packed rows -> one global, sharded jax.Array batch.

Train: `make_train_iterator(config, batch_sharding)` yields dicts of global arrays of shape
[config.data.global_batch_size, config.data.seq_len]:

  inputs        int32    token ids fed to the model (targets shifted right, 0 at each document start)
  targets       int32    token ids to predict; 0 is padding
  segment_ids   int32    1, 2, ... per packed document piece; 0 on padding (attention stays within one)
  positions     int32    0, 1, ... restarting at each piece
  loss_weights  float32  1 on real tokens, 0 on padding

Each process builds only the rows of the global batch its devices hold: it reads data shard
`ShardInfo(index, count)`, where `count` is the number of distinct row blocks of `batch_sharding`
and `index` the block this process holds (= process_index / process_count when the batch axis
is split over all processes), then `jax.make_array_from_process_local_data` assembles the global
array without any cross-host copy.

This is the on-the-fly path (config.data.tokenized_dir == ""), for small corpora: it tokenizes at train time, and
its state resumes only on the same number of data shards (processes). A tokenized corpus (sparsetx-tokenize) is
read by sparsetx/data/global_stream.py instead, whose batches are a pure function of the step and resume on any
number of processes; `warn_if_pretokenizing_pays` says so once for a large corpus or several processes.

Resume: `iterator.save(path)` writes the state of this process's tf.data iterator as a
TensorFlow checkpoint (`tf.train.Checkpoint`, no pickle) plus a small JSON file, under
`path/shard_<index>_of_<count>/`; `iterator.restore(path)` on a freshly built iterator continues
with the identical stream (so does a restore on an iterator already read from: it rebuilds the
dataset first). Every process saves and restores its own shard (no collective). The
checkpoint holds positions, not data already consumed: the file readers' offsets, the file order,
the mixture sampler's RNG, and the contents of the shuffle buffers and of the packer's window, so
restoring costs one read of the checkpoint (about `shuffle_buffer` examples per task, a few MB)
and never re-reads the corpus. The restore refuses a state written under a different data config
or data sharding, naming the field. The state cannot be a small JSON value because shuffle
buffers are part of it; store it next to each model checkpoint (e.g. `<workdir>/data/<step>`).

Eval: `make_eval_iterator(config, batch_sharding, split)` goes once, in order, over the split of
each mixture task that has one (no shuffle, packed like training), with a zero-padded last
batch (loss_weights 0). All processes yield the same number of batches: shorter shards are
padded with all-padding batches, agreed through one `process_allgather`.
"""

import contextlib
import gc
import json
import logging
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np
import seqio
import tensorflow as tf
from absl import logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import file_checks, tasks, vocab

try:  # TensorFlow must not take the accelerators JAX uses.
  tf.config.set_visible_devices([], "GPU")
  tf.config.set_visible_devices([], "TPU")
except (RuntimeError, ValueError):  # already initialized or no such device type
  pass

FEATURES = ("inputs", "targets", "segment_ids", "positions", "loss_weights")
_CONVERTER_NAMES = {
  "decoder_input_tokens": "inputs",
  "decoder_target_tokens": "targets",
  "decoder_segment_ids": "segment_ids",
  "decoder_positions": "positions",
  "decoder_loss_weights": "loss_weights",
}
STATE_FORMAT = 1
_STATE_JSON = "data_state.json"
_STATE_PREFIX = "iterator"
# The config.data fields the stream depends on; a restore checks each one.
_STREAM_FIELDS = ("mixture", "sources", "vocab", "seq_len", "global_batch_size", "seed", "shuffle_buffer", "pack")


def data_shard(batch_sharding: jax.sharding.Sharding, global_batch_size: int) -> tuple[seqio.ShardInfo, int]:
  """This process's data shard and row count, from the rows of the batch its devices hold."""
  index_map = batch_sharding.addressable_devices_indices_map((global_batch_size,))
  rows = set()
  for index in index_map.values():
    rows.update(range(*index[0].indices(global_batch_size)))
  local_rows = len(rows)
  first = min(rows)
  if rows != set(range(first, first + local_rows)) or global_batch_size % local_rows or first % local_rows:
    raise ValueError(
      f"batch_sharding gives this process rows {sorted(rows)[:8]}... of config.data.global_batch_size="
      f"{global_batch_size}, not one contiguous block of equal size; shard the batch axis over whole processes."
    )
  return seqio.ShardInfo(index=first // local_rows, num_shards=global_batch_size // local_rows), local_rows


def _feature_converter(pack: bool) -> seqio.FeatureConverter:
  return seqio.LMFeatureConverter(pack=pack)


def _to_model_features(example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """Renames converter features; unpacked rows get segment 1 and positions 0.. on their tokens."""
  out = {_CONVERTER_NAMES[k]: v for k, v in example.items()}
  nonpad_T = tf.cast(tf.not_equal(out["targets"], 0), tf.int32)
  if "segment_ids" not in out:  # unpacked: seqio shifts the last EOS into the first padding input
    out["inputs"] = out["inputs"] * nonpad_T
    out["segment_ids"] = nonpad_T
    out["positions"] = tf.range(tf.shape(nonpad_T)[-1], dtype=tf.int32) * nonpad_T
  out["loss_weights"] = tf.cast(out["loss_weights"], tf.float32)
  return out


def _with_options(dataset: tf.data.Dataset) -> tf.data.Dataset:
  options = tf.data.Options()
  options.deterministic = True
  # The only op with "external state" is the pure json.loads of JSONL sources; it is safe to
  # checkpoint around it (the parallel map is deterministic and its buffered results are saved).
  options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
  return dataset.with_options(options)


class _UncachedFunctionDatasetWarning(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Using an uncached FunctionDataset for training")


@contextlib.contextmanager
def _known_uncached_function_datasets():
  """seqio warns that an uncached FunctionDataSource (the embedded corpus, sources.py) reshuffles poorly on
  restarts; here a restart restores the exact iterator (shuffle buffers included), so the warning is dropped."""
  absl_logger, warning = absl_logging.get_absl_logger(), _UncachedFunctionDatasetWarning()
  absl_logger.addFilter(warning)
  try:
    yield
  finally:
    absl_logger.removeFilter(warning)


def local_train_dataset(
  config: ml_collections.ConfigDict, shard_info: seqio.ShardInfo, local_rows: int
) -> tf.data.Dataset:
  """This process's endless stream of packed batches [local_rows, seq_len] (a tf.data.Dataset)."""
  file_checks.check_files(config_lib.validate(config))
  data = config.data
  vocabulary = vocab.make_vocabulary(data, config.model.vocab_size)
  mixture = tasks.register_mixture(data, vocabulary)
  lengths = {"targets": data.seq_len}
  with _known_uncached_function_datasets():
    dataset = mixture.get_dataset(
      lengths,
      split="train",
      shuffle=True,
      seed=data.seed,
      shard_info=shard_info,
      num_epochs=None,
      try_in_mem_cache=False,
    )
  dataset = _feature_converter(data.pack)(dataset, task_feature_lengths=lengths)
  dataset = dataset.map(_to_model_features, num_parallel_calls=tf.data.AUTOTUNE)
  dataset = dataset.batch(local_rows, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  return _with_options(dataset)


def _global_batch(
  local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, global_rows: int
) -> dict[str, jax.Array]:
  return {
    k: jax.make_array_from_process_local_data(sharding, local[k], (global_rows,) + local[k].shape[1:]) for k in FEATURES
  }


def _stream_config(data: ml_collections.ConfigDict) -> dict:
  """The JSON view of the fields that determine the stream (tuples become lists)."""
  return json.loads(
    json.dumps({k: data[k].to_dict() if hasattr(data[k], "to_dict") else data[k] for k in _STREAM_FIELDS})
  )


class TrainIterator:
  """Yields global train batches; `save(path)` / `restore(path)` checkpoint its position."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    batch_sharding: jax.sharding.Sharding,
    shard_info: seqio.ShardInfo | None = None,
  ):
    self._sharding = batch_sharding
    self._global_rows = config.data.global_batch_size
    derived, local_rows = data_shard(batch_sharding, self._global_rows)
    self.shard_info = shard_info or derived
    self._config, self._local_rows = config, local_rows
    self._stream = _stream_config(config.data)
    self._build()
    self.steps = 0  # batches yielded since the start of the stream (restored by `restore`)

  def _build(self) -> None:
    """A new dataset and iterator: the state a restore must start from.

    Seeded shuffles that reshuffle each epoch (seqio's file shuffle) keep their seed generator in
    the *dataset*, not the iterator, and a checkpoint records it only once that shuffle's iterator
    exists. Restoring into an iterator of a dataset that has already been read would continue
    from the advanced generator (another file order), so `restore` starts from a fresh dataset.
    """
    self._dataset = local_train_dataset(self._config, self.shard_info, self._local_rows)
    self._iterator = iter(self._dataset)
    self._checkpoint = tf.train.Checkpoint(iterator=self._iterator)
    self._read = False  # whether this dataset has yielded anything

  def __iter__(self) -> "TrainIterator":
    return self

  def next_local(self) -> dict[str, np.ndarray]:
    """This process's rows of the next batch, as numpy (what `__next__` makes global)."""
    self._read = True
    batch = {k: v.numpy() for k, v in next(self._iterator).items()}
    self.steps += 1
    return batch

  def __next__(self) -> dict[str, jax.Array]:
    return _global_batch(self.next_local(), self._sharding, self._global_rows)

  def close(self) -> None:
    """Releases the tf.data iterator now. One still alive at interpreter exit, with Python code in the
    stream (JSONL parsing, the GPT-2 tokenizer), can hang the process's shutdown."""
    self._iterator = self._dataset = self._checkpoint = None
    gc.collect()

  def _shard_dir(self, path: epath.PathLike) -> epath.Path:
    return epath.Path(path) / f"shard_{self.shard_info.index:05d}_of_{self.shard_info.num_shards:05d}"

  def save(self, path: epath.PathLike) -> epath.Path:
    """Writes this process's stream position under `path` (local or a URL); returns the shard directory."""
    shard_dir = self._shard_dir(path)
    with paths.local_staging() as local:  # TensorFlow writes its checkpoint; epath copies it to the workdir
      self._checkpoint.write(str(local / _STATE_PREFIX))
      paths.copy_tree(local, shard_dir)
    state = dict(
      format=STATE_FORMAT,
      steps=self.steps,
      shard_index=self.shard_info.index,
      num_shards=self.shard_info.num_shards,
      data=self._stream,
    )
    # Written last: its presence marks a complete state.
    (shard_dir / _STATE_JSON).write_text(json.dumps(state, indent=1, sort_keys=True))
    return shard_dir

  def restore(self, path: epath.PathLike) -> None:
    """Continues the stream saved by `save(path)` under the same data config and sharding."""
    shard_dir = self._shard_dir(path)
    state_file = shard_dir / _STATE_JSON
    if not state_file.exists():
      raise ValueError(
        f"no data state for shard {self.shard_info.index} of {self.shard_info.num_shards} at {str(shard_dir)!r}; "
        "it was not saved (or saved with another number of data shards, which cannot be resharded): "
        "restore from a complete checkpoint written with the same batch sharding."
      )
    state = json.loads(state_file.read_text())
    if state.get("format") != STATE_FORMAT:
      raise ValueError(
        f"{str(state_file)!r} has data state format {state.get('format')!r}; this code reads {STATE_FORMAT}."
      )
    for field in _STREAM_FIELDS:
      if state["data"].get(field) != self._stream[field]:
        raise config_lib.ConfigError(
          f"the data state at {str(shard_dir)!r} was saved with config.data.{field}={state['data'].get(field)!r}, "
          f"but the config now has {self._stream[field]!r}; restore with the same value or start the data stream fresh."
        )
    if self._read:
      self._build()
    with paths.local_staging() as local:  # epath brings the checkpoint where TensorFlow reads it
      paths.copy_tree(shard_dir, local)
      self._checkpoint.read(str(local / _STATE_PREFIX)).assert_consumed()
    self.steps = state["steps"]


def saved_shard_counts(path: epath.PathLike) -> set[int]:
  """The numbers of data shards that saved states under `path` (empty when none was saved)."""
  return {json.loads(state_file.read_text())["num_shards"] for state_file in epath.Path(path).glob(f"*/{_STATE_JSON}")}


def check_saved_state(path: epath.PathLike) -> None:
  """Raises ValueError naming what is missing or unreadable among the data states saved under `path`: every
  data shard (process) of the count that saved them, its JSON and its TensorFlow iterator checkpoint (read in
  full: a few MB). The checkpoint opener calls this before anything is built, so a damaged state is reported
  in one line instead of failing inside TensorFlow at the restore."""
  path = epath.Path(path)
  shard_dirs = sorted(path.glob("shard_*_of_*")) if path.is_dir() else []
  if not shard_dirs:
    raise ValueError(f"its data state {path} is missing")
  counts = set()
  for shard_dir in shard_dirs:
    state_file = shard_dir / _STATE_JSON
    if not state_file.exists():
      raise ValueError(f"its data state file {state_file} is missing")
    try:
      state = json.loads(state_file.read_text())
      counts.add(int(state["num_shards"]))
    except (ValueError, KeyError, TypeError) as error:
      raise ValueError(f"its data state file {state_file} is unreadable ({type(error).__name__}: {error})") from None
    prefix = shard_dir / _STATE_PREFIX
    with paths.local_staging() as local:  # TensorFlow reads the checkpoint where epath copied it
      paths.copy_tree(shard_dir, local)
      try:
        tf.train.load_checkpoint(str(local / _STATE_PREFIX))  # the index: which variables, in how many data files
      except (tf.errors.OpError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"its data iterator checkpoint {prefix} is unreadable ({reason})") from None
      data_files = {p.name: p for p in local.glob(f"{_STATE_PREFIX}.data-*-of-*")}
      parts = int(next(iter(data_files)).rsplit("-of-", 1)[1]) if data_files else 1
      for part in range(parts):
        name = f"{_STATE_PREFIX}.data-{part:05d}-of-{parts:05d}"
        if name not in data_files or data_files[name].stat().length == 0:
          raise ValueError(f"its data iterator checkpoint file {shard_dir / name} is missing or empty")
  names = {d.name for d in shard_dirs}
  for count in sorted(counts):
    for index in range(count):
      shard_dir = path / f"shard_{index:05d}_of_{count:05d}"
      if shard_dir.name not in names:
        raise ValueError(f"its data state lacks shard {index} of {count} ({shard_dir} is missing)")


LARGE_CORPUS_BYTES = 1 << 30  # on-the-fly sources above this (1 GiB) are worth tokenizing once


def _source_bytes(data: ml_collections.ConfigDict, limit: int) -> int:
  """The size of the mixture's local source files, counted up to `limit` (TFDS and remote files count 0)."""
  total = 0
  for name, _ in data.mixture:
    source = (data.sources or {}).get(name)
    if source is None or source.get("kind") == "tfds":
      continue
    for key in ("train", "validation"):
      for pattern in config_lib.source_patterns(source.get(key)):
        for path in [] if "://" in pattern else tf.io.gfile.glob(pattern):
          total += tf.io.gfile.stat(path).length
          if total >= limit:
            return total
  return total


def warn_if_pretokenizing_pays(config: ml_collections.ConfigDict) -> None:
  """One warning line when the on-the-fly path is the wrong tool: several processes (a checkpoint then resumes
  its data only on as many) or sources of a GiB or more (tokenized again by every run, under the GIL)."""
  processes = jax.process_count()
  if processes == 1 and _source_bytes(config.data, LARGE_CORPUS_BYTES) < LARGE_CORPUS_BYTES:
    return
  why = f"{processes} processes" if processes > 1 else "sources of 1 GiB or more"
  absl_logging.warning(
    "Tokenizing config.data.mixture on the fly with %s: run sparsetx-tokenize once and train with "
    "--config.data.tokenized_dir=DIR (no tokenizer at train time; a checkpoint then resumes its data stream on any "
    "number of processes).",
    why,
  )


def make_train_iterator(
  config: ml_collections.ConfigDict, batch_sharding: jax.sharding.Sharding, shard_info: seqio.ShardInfo | None = None
) -> TrainIterator:
  """The training batches of `config.data`; `shard_info` overrides the derived data shard (tests)."""
  return TrainIterator(config, batch_sharding, shard_info)


def local_eval_batches(
  config: ml_collections.ConfigDict, name: str, split: str, shard_info: seqio.ShardInfo, local_rows: int
) -> list[dict[str, np.ndarray]]:
  """One deterministic pass over task `name`'s split for this shard, the last batch zero-padded."""
  data = config.data
  lengths = {"targets": data.seq_len}
  task = seqio.get_mixture_or_task(tasks.task_name(name))  # registered by EvalData (or the caller)
  dataset = task.get_dataset(
    lengths, split=split, shuffle=False, shard_info=shard_info, num_epochs=1, try_in_mem_cache=False
  )
  dataset = _feature_converter(data.pack)(dataset, task_feature_lengths=lengths)
  dataset = _with_options(dataset.map(_to_model_features).batch(local_rows))
  batches = []
  for batch in dataset.as_numpy_iterator():
    pad = local_rows - batch["targets"].shape[0]
    batches.append({k: np.pad(v, [(0, pad), (0, 0)]) for k, v in batch.items()})
  return batches


class EvalData:
  """The validation batches of every mixture task, computed once; iterate it as often as needed."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    batch_sharding: jax.sharding.Sharding,
    split: str = "validation",
    shard_info: seqio.ShardInfo | None = None,
  ):
    file_checks.check_files(config_lib.validate(config))
    data = config.data
    self._sharding = batch_sharding
    self._global_rows = data.eval_batch_size
    derived, local_rows = data_shard(batch_sharding, self._global_rows)
    shard_info = shard_info or derived
    tasks.register_mixture(data, vocab.make_vocabulary(data, config.model.vocab_size))  # the tasks named below
    names = [name for name, _ in data.mixture if split in seqio.get_mixture_or_task(tasks.task_name(name)).splits]
    if not names:
      raise config_lib.ConfigError(
        f"no task of config.data.mixture has a {split!r} split; give one, e.g. "
        f"config.data.sources.<name>.{split}, or evaluate another split."
      )
    self.batches = {name: local_eval_batches(config, name, split, shard_info, local_rows) for name in names}
    counts = np.array([len(self.batches[name]) for name in names], np.int32)
    if jax.process_count() > 1:
      counts = np.max(multihost_utils.process_allgather(counts), axis=0)
    empty = {k: np.zeros((local_rows, data.seq_len), np.float32 if k == "loss_weights" else np.int32) for k in FEATURES}
    for name, count in zip(names, counts):
      self.batches[name] += [empty] * (int(count) - len(self.batches[name]))

  @property
  def task_names(self) -> list[str]:
    return list(self.batches)

  def task_iterator(self, name: str) -> Iterator[dict[str, jax.Array]]:
    for local in self.batches[name]:
      yield _global_batch(local, self._sharding, self._global_rows)

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    for name in self.batches:
      yield from self.task_iterator(name)


def make_eval_iterator(
  config: ml_collections.ConfigDict, batch_sharding: jax.sharding.Sharding, split: str = "validation"
) -> Iterator[dict[str, jax.Array]]:
  """One pass over `split` of every mixture task that has it, task after task (see EvalData)."""
  return iter(EvalData(config, batch_sharding, split))
