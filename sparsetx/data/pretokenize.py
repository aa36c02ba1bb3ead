"""Writes a tokenized corpus (`sparsetx.data.token_store`) from config.data's tasks: what `sparsetx-tokenize` runs.

More: docs/modules.md, sparsetx/data/pretokenize.py.
"""

import dataclasses
import functools
import itertools
import json
import time
from collections.abc import Callable

import ml_collections
from etils import epath

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import documents as documents_lib
from sparsetx.data import token_store

PLAN = "tokenize.json"
WORKDIR_CORPUS = "tokenized"  # <workdir>/tokenized: what a run without config.data.tokenized_dir trains on
OUTPUT_DIR_FIX = "give another --output_dir, or --overwrite to replace it."
WORKDIR_FIX = "set config.data back to what this run trained on, or start over in a new --workdir."
SPLITS = ("train", "validation")


class ShardError(config_lib.ConfigError):  # bad input: one `error:` line and exit 2 in every program
  """A shard could not be tokenized (its source holds bad input); the message names the shard and the fix."""


@dataclasses.dataclass(frozen=True)
class ShardJob:
  task: str
  split: str
  index: int
  count: int
  path: str
  inputs: tuple[str, ...] = ()  # the split's input files (the plan's), which the shards divide

  @property
  def name(self) -> str:
    return f"{self.task}/{self.split}/{token_store.shard_name(self.index, self.count)}"


@dataclasses.dataclass
class Progress:
  """Where a run stands: shards complete (skipped ones included) and what this run has tokenized so far."""

  shards_done: int
  shards_total: int
  shards_skipped: int
  documents: int
  tokens: int
  seconds: float
  final: bool = False

  @property
  def tokens_per_second(self) -> float:
    return self.tokens / self.seconds if self.seconds > 0 else 0.0


def vocabulary_record(data: ml_collections.ConfigDict, vocabulary) -> dict:
  """manifest["vocabulary"]: what the trainer compares with its own config.data.vocab."""
  return {
    "kind": data.vocab.kind,
    "path": data.vocab.path,
    "vocab_size": int(vocabulary.vocab_size),
    "eos_id": int(vocabulary.eos_id),
  }


def source_record(data: ml_collections.ConfigDict, name: str) -> dict:
  """The JSON view of config.data.sources.<name> ({} for a task of the embedded corpus)."""
  source = (data.sources or {}).get(name)
  return {} if source is None else json.loads(json.dumps(source.to_dict()))


def make_plan(data: ml_collections.ConfigDict, workers: int, shards: int = 0) -> dict:
  """The corpus to write: vocabulary, each mixture task's source, input files and shard count per split."""
  from sparsetx.data import tasks, vocab  # TensorFlow and seqio: loaded when a corpus is planned, not on import

  vocabulary = vocab.make_vocabulary(data)
  plan = dict(format=token_store.FORMAT, vocabulary=vocabulary_record(data, vocabulary), sources={}, inputs={})
  plan["tasks"] = {}
  for name, _ in data.mixture:
    task = tasks.text_task(name, data)
    plan["sources"][name] = source_record(data, name)
    inputs = {split: [str(f) for f in task.source.list_shards(split)] for split in SPLITS if split in task.splits}
    plan["inputs"][name] = inputs
    plan["tasks"][name] = {split: shards or max(len(files), workers) for split, files in inputs.items()}
  return plan


def read_previous(output_dir: epath.Path) -> dict | None:
  """The plan of an earlier run into `output_dir` (or, without one, its manifest); None for a new corpus."""
  for name in (PLAN, token_store.MANIFEST):
    path = output_dir / name
    try:
      return json.loads(path.read_text())
    except FileNotFoundError:
      continue
    except (OSError, ValueError) as error:
      raise config_lib.ConfigError(
        f"{path} is unreadable ({paths.reason(error)}); delete it or rerun with --overwrite."
      ) from None
  return None


def reconcile(
  previous: dict | None, plan: dict, output_dir: epath.Path, shards_given: bool, fix: str = OUTPUT_DIR_FIX
) -> dict:
  """`plan`, resumed from `previous`: its shard counts kept (unless given), its tasks outside the mixture carried
  over. A corpus tokenized differently is a `ConfigError` naming the differences."""
  if previous is None:
    return plan
  differences = []
  if previous.get("vocabulary") != plan["vocabulary"]:
    differences.append(f"the vocabulary there is {previous.get('vocabulary')}, here {plan['vocabulary']}")
  for name, counts in plan["tasks"].items():
    before = previous.get("tasks", {}).get(name)
    if before is None:
      continue  # a task added to the corpus
    source = previous.get("sources", {}).get(name, {})
    if source != plan["sources"][name]:
      differences.append(f"task {name!r} has source {source} there, {plan['sources'][name]} here")
    elif "inputs" in previous and previous["inputs"].get(name) != plan["inputs"][name]:
      differences.append(f"the input files of task {name!r} changed")
    elif sorted(before) != sorted(counts) or (shards_given and before != counts):
      differences.append(f"task {name!r} has shards {before} there, {counts} here")
    else:
      plan["tasks"][name] = dict(before)
  if differences:
    raise config_lib.ConfigError(
      f"{output_dir} holds a corpus tokenized with another config ({'; '.join(differences)}); {fix}"
    )
  for name, counts in previous.get("tasks", {}).items():
    if name not in plan["tasks"]:
      plan["tasks"][name] = counts
      plan["sources"][name] = previous.get("sources", {}).get(name, {})
      if "inputs" in previous and name in previous["inputs"]:
        plan["inputs"][name] = previous["inputs"][name]
  return plan


def shard_jobs(tasks: dict[str, dict[str, int]], output_dir: epath.Path, inputs: dict | None = None) -> list[ShardJob]:
  """Every shard of `tasks` ({task: {split: shard count}}), in task, split, index order; `inputs` is the plan's
  {task: {split: input files}}."""
  inputs = inputs or {}
  return [
    ShardJob(
      name,
      split,
      i,
      count,
      str(token_store.split_dir(output_dir, name, split) / token_store.shard_name(i, count)),
      tuple(inputs.get(name, {}).get(split, ())),
    )
    for name, counts in tasks.items()
    for split, count in counts.items()
    for i in range(count)
  ]


# --- one shard (in a worker process, or in this one with a single worker)

_ENCODERS = {}  # data config JSON -> (batch encoder, vocab size): a worker loads its vocabulary once
_BATCH = 1024  # documents per batch out of tf.data, encoded in one call of the native tokenizer


def _text_batches(job: ShardJob, config_data: ml_collections.ConfigDict):
  """Lists of the shard's documents (text), _BATCH at a time: read in Python (documents.py, corpus.py), or through
  TensorFlow for TFRecord and TFDS sources (the seqio task's reader, one batch ahead)."""
  from sparsetx.data import corpus, documents

  source = (config_data.sources or {}).get(job.task)
  if source is None or source.kind in documents.READERS:
    if source is None:  # the embedded corpus: one in-memory "file" per split
      texts = itertools.islice(corpus.DOCUMENTS[job.task](job.split), job.index, None, job.count)
    else:
      read = functools.partial(documents.READERS[source.kind], field=source.get("text_field", "text"))
      texts = documents.shard_documents(list(job.inputs), read, job.index, job.count)
    texts = (text for text in texts if text.strip(documents.BLANK))  # the task's blank-document filter
    while batch := list(itertools.islice(texts, _BATCH)):
      yield batch
    return
  import seqio
  import tensorflow as tf

  from sparsetx.data import tasks

  try:  # TensorFlow reads files only: the accelerators stay the trainer's (tokenizing in the trainer's process)
    tf.config.set_visible_devices([], "GPU")
    tf.config.set_visible_devices([], "TPU")
  except (RuntimeError, ValueError):  # already initialized, or no such device type
    pass
  dataset = tasks.text_task(job.task, config_data).get_dataset(
    None,
    split=job.split,
    shuffle=False,
    shard_info=seqio.ShardInfo(job.index, job.count),
    num_epochs=1,
    try_in_mem_cache=False,
  )
  options = tf.data.Options()
  options.deterministic = True  # a rewritten shard equals the first write
  batches = dataset.map(lambda example: example["targets"]).batch(_BATCH).prefetch(1).with_options(options)
  try:
    for texts in batches.as_numpy_iterator():
      yield [text.decode("utf-8") for text in texts]
  except (tf.errors.OpError, UnicodeDecodeError) as error:  # a record TensorFlow cannot read, or not UTF-8 text
    raise documents.DocumentError(f"{_reason(error)}; fix that input of config.data.sources.{job.task}.") from None


def document_stream(job: ShardJob, data: dict):
  """(tokens of each document of the job's shard, in order, as numpy arrays; the vocabulary size). Each batch of
  texts is encoded in the vocabulary's native library (encoders.py)."""
  from sparsetx.data import encoders, vocab

  key = json.dumps(data, sort_keys=True, default=str)
  if key not in _ENCODERS:
    vocabulary = vocab.make_vocabulary(ml_collections.ConfigDict(data))
    _ENCODERS[key] = encoders.batch_encoder(vocabulary), vocabulary.vocab_size
  encode, vocab_size = _ENCODERS[key]

  def documents():
    for texts in _text_batches(job, ml_collections.ConfigDict(data)):
      yield from encode(texts)

  return documents(), vocab_size


def _reason(error: Exception) -> str:
  """The message a TensorFlow op error carries from the Python function that raised it (a JSONL parse)."""
  text = getattr(error, "message", None) or str(error)
  for line in text.splitlines():
    for kind in ("DocumentError: ", "ValueError: ", "UnicodeDecodeError: "):
      if kind in line:
        return line.split(kind, 1)[1].strip()
  return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def write_one(job: ShardJob, data: dict, report: Callable[[ShardJob, int, int], None] | None = None) -> dict:
  """Tokenizes the job's shard and writes it (token_store.write_shard); returns its record."""
  counts = [0, 0, time.monotonic()]

  def documents():
    for tokens in stream:
      counts[0] += 1
      counts[1] += tokens.size
      if counts[0] % 256 == 0:
        if report is not None and time.monotonic() - counts[2] > 0.5:
          report(job, counts[0], counts[1])
          counts[2] = time.monotonic()
      yield tokens

  try:
    stream, vocab_size = document_stream(job, data)
    with paths.writing(f"writing shard {job.path}", f"{paths.FREE_SPACE} (complete shards are kept)"):
      return token_store.write_shard(job.path, documents(), vocab_size)
  except documents_lib.DocumentError as error:
    raise ShardError(
      f"shard {job.name} failed: {str(error).rstrip('.')}; then run the same command again (complete shards are kept)."
    ) from None


# --- a whole corpus


def tokenize_corpus(
  config: ml_collections.ConfigDict,
  output_dir: epath.PathLike,
  workers: int = 1,
  shards: int = 0,
  overwrite: bool = False,
  progress: Callable[[Progress], None] | None = None,
  mismatch_fix: str = OUTPUT_DIR_FIX,
  ray_address: str = "",
) -> dict:
  """Writes (or finishes) the tokenized corpus of `config.data` in `output_dir`; returns its manifest record.

  `workers` > 1 tokenizes that many shards at a time on a local Ray runner (tokenize_ray.py), or on the Ray
  cluster at `ray_address`; 1 (and no address) runs them here. `shards` > 0 sets the shard count of every split. Raises `ConfigError` for a bad config or a conflicting corpus, `ShardError` for bad input.
  """
  from sparsetx.data import check_files

  check_files(config_lib.validate(config))
  if workers < 1:
    raise config_lib.ConfigError(f"--workers={workers} must be at least 1.")
  if shards < 0:
    raise config_lib.ConfigError(f"--shards={shards} must be 0 (one per input file) or positive.")
  output_dir = paths.resolve(output_dir)
  if output_dir.exists() and not output_dir.is_dir():
    raise config_lib.ConfigError(f"--output_dir={output_dir} is a file; give a directory (new or a corpus to finish).")
  data = config.data
  plan = make_plan(data, workers, shards)
  previous = read_previous(output_dir) if output_dir.exists() else None
  if overwrite:
    for name in {*plan["tasks"], *((previous or {}).get("tasks", {}))}:
      if (output_dir / name).exists():
        (output_dir / name).rmtree()
    for name in (token_store.MANIFEST, PLAN):
      (output_dir / name).unlink(missing_ok=True)
    previous = None
  plan = reconcile(previous, plan, output_dir, shards_given=shards > 0, fix=mismatch_fix)
  try:
    output_dir.mkdir(parents=True, exist_ok=True)
    paths.write_text_atomically(output_dir / PLAN, json.dumps(plan, indent=1, sort_keys=True))
  except OSError as error:
    raise config_lib.ConfigError(
      f"cannot write to --output_dir={output_dir} ({paths.reason(error)}); give a writable directory."
    ) from None
  mixture = {name: plan["tasks"][name] for name, _ in data.mixture}
  jobs = shard_jobs(mixture, output_dir, plan["inputs"])
  todo = [job for job in jobs if not token_store.shard_complete(job.path)]
  if todo:  # the corpus is incomplete until every shard is written
    (output_dir / token_store.MANIFEST).unlink(missing_ok=True)
  _run_jobs(todo, len(jobs), data.to_dict(), workers, progress, ray_address)
  tasks = dict(mixture)
  for name, counts in plan["tasks"].items():  # tasks of an earlier run, outside this mixture: listed if complete
    if name not in tasks and all(token_store.shard_complete(j.path) for j in shard_jobs({name: counts}, output_dir)):
      tasks[name] = counts
  sources = {name: plan["sources"].get(name, {}) for name in tasks}
  with paths.writing(f"writing {output_dir / token_store.MANIFEST}", f"{paths.FREE_SPACE} (complete shards are kept)"):
    token_store.write_manifest(output_dir, plan["vocabulary"], tasks, sources=sources)
  return token_store.read_manifest(output_dir)


def train_corpus(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """`config` with the corpus it trains on in config.data.tokenized_dir: as given, or else <workdir>/tokenized,
  written here from config.data's tasks on the first run (by process 0, the others wait) and reused after. The
  embedded corpus takes seconds; a real corpus is tokenized once with sparsetx-tokenize (workers, one shard per
  file) and named by tokenized_dir, which the target rungs require (config.data.require_tokenized)."""
  import jax
  from jax.experimental import multihost_utils

  if config.data.tokenized_dir:
    return config
  if config.data.require_tokenized:
    raise config_lib.ConfigError(
      "config.data.tokenized_dir is empty, but this config trains from a pre-tokenized corpus "
      "(config.data.require_tokenized): write one with sparsetx-tokenize (same --config), then train with "
      "--config.data.tokenized_dir=DIR."
    )
  corpus_dir = paths.resolve(workdir) / WORKDIR_CORPUS
  if jax.process_index() == 0:
    tokenize_corpus(config, corpus_dir, mismatch_fix=WORKDIR_FIX)
  if jax.process_count() > 1:  # written before any process reads it
    multihost_utils.sync_global_devices("train_corpus")
  config = config.copy_and_resolve_references()
  config.data.tokenized_dir = str(corpus_dir)
  return config


def _run_jobs(
  todo: list[ShardJob],
  total: int,
  data: dict,
  workers: int,
  progress: Callable[[Progress], None] | None,
  ray_address: str = "",
) -> None:
  start = time.monotonic()
  state = dict(done=total - len(todo), documents=0, tokens=0, partial={}, finished=set(), last=0.0)

  def update(final: bool = False) -> None:
    now = time.monotonic()
    if progress is None or (not final and now - state["last"] < 0.25):
      return
    state["last"] = now
    partial_documents = sum(d for d, _ in state["partial"].values())
    partial_tokens = sum(t for _, t in state["partial"].values())
    progress(
      Progress(
        shards_done=state["done"],
        shards_total=total,
        shards_skipped=total - len(todo),
        documents=state["documents"] + partial_documents,
        tokens=state["tokens"] + partial_tokens,
        seconds=now - start,
        final=final,
      )
    )

  def partial(name: str, documents: int, tokens: int) -> None:
    if name not in state["finished"]:  # a worker's last message may arrive after its shard's result
      state["partial"][name] = (documents, tokens)
      update()

  def finished(job: ShardJob, record: dict) -> None:
    state["partial"].pop(job.name, None)
    state["finished"].add(job.name)
    state["done"] += 1
    state["documents"] += record["n_documents"]
    state["tokens"] += record["n_tokens"]
    update()

  update()
  if not ray_address and (workers == 1 or len(todo) <= 1):
    for job in todo:
      finished(job, write_one(job, data, lambda j, d, t: partial(j.name, d, t)))
  else:
    from sparsetx.data import tokenize_ray

    write = functools.partial(write_one, data=data)
    tokenize_ray.run(
      todo, write, min(workers, len(todo)), ray_address, finished, error_types=(ShardError, paths.StorageError)
    )
  update(final=True)
