"""Input throughput per host: the tokenize job against its tokenizer, and the token store against what training
consumes.

  python -m sparsetx.tools.bench_data [--input=GLOB] [--megabytes=8] [--vocab=DIR] [--steps=20] [--rows=0]
      [--seq_len=0] [--bar=configs/ladder.py:sgatlin,5,h100x8] [--target=] [--chips_per_host=0] [--workers=1]

More: docs/modules.md, sparsetx/tools/bench_data.py.
"""

import dataclasses
import os
import random
import tempfile
import threading
from types import SimpleNamespace

import jax
import ml_collections
import numpy as np
from absl import flags

from sparsetx import cli, hardware
from sparsetx import config as config_lib
from sparsetx.data import bpe_vocab, corpus, global_stream, pretokenize, token_store, vocab
from sparsetx.perf import roofline, timing
from sparsetx.plan import step_cost, targets

ENCODE_BATCH = 1024  # documents per encode_batch call: the tokenize job's batch (pretokenize._BATCH)
TASK = "bench"  # the benchmark's one task: the text files
BPE_DOCUMENTS = 20_000  # documents a BPE trained here learns from


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    input=flags.DEFINE_string("input", "", "Glob of text files, one document per line; empty: generate --megabytes."),
    megabytes=flags.DEFINE_float("megabytes", 8.0, "Text generated from the embedded corpus when --input is empty."),
    vocab=flags.DEFINE_string("vocab", "", "A GPT-2 BPE (vocab.json + merges.txt directory, or tokenizer.json)."),
    vocab_size=flags.DEFINE_integer("vocab_size", 8192, "Ids of the BPE trained here when --vocab is empty."),
    rows=flags.DEFINE_integer("rows", 0, "Rows per step this host reads; 0: the bar's rows per host."),
    seq_len=flags.DEFINE_integer("seq_len", 0, "Tokens per row; 0: the bar's."),
    bar=cli.define_config_file(
      "bar", "configs/ladder.py:sgatlin,5,h100x8", "The run whose consumption is the bar (a config sized for a target)."
    ),
    target=flags.DEFINE_string(
      "target", "", "The bar's machine (h100x8, v5p-64, ...); empty: the one its config names."
    ),
    chips_per_host=flags.DEFINE_integer(
      "chips_per_host", 0, "Chips one host feeds; 0: the target's (Target.per_host)."
    ),
    workers=flags.DEFINE_integer("workers", 1, "Tokenizer processes of the tokenize job."),
    steps=flags.DEFINE_integer("steps", 20, "Batches timed per path (after two warm-up ones)."),
  )


# ---------------------------------------------------------------------------------------------------------------
# The bar: what training consumes


@dataclasses.dataclass(frozen=True)
class Bar:
  spec: str
  chip: hardware.Chip
  devices: int  # chips of the run
  chips_per_host: int
  global_rows: int
  seq_len: int
  projection: roofline.Projection  # of the whole run's step

  @property
  def per_chip(self) -> float:
    """Tokens/s one chip consumes."""
    return self.projection.tokens_per_s_overlap / self.devices

  @property
  def per_host(self) -> float:
    return self.per_chip * self.chips_per_host

  @property
  def host_rows(self) -> int:
    """Rows of each step one host reads."""
    return self.global_rows * self.chips_per_host // self.devices


def training_bar(config, target_name: str = "", chips_per_host: int = 0) -> Bar:
  """The bar of a run (`config`, on the target it is sized for or `target_name`): its step as the dry run projects it
  analytically (step_cost.project_step on the target's mesh), per chip and per host."""
  target_name = target_name or config.mesh.get("target", "")
  if not target_name:
    raise config_lib.ConfigError(
      "--bar names a config sized for no machine; give --target (e.g. h100x8) or a rung on a target, as "
      "configs/ladder.py:sgatlin,5,h100x8."
    )
  config = config_lib.validate(config)
  target = targets.parse(target_name)
  chips_per_host = min(chips_per_host if chips_per_host > 0 else target.per_host, target.devices)
  spec = f"{config.model.ffn.type} d_model {config.model.d_model} on {target.name}"
  if config.data.global_batch_size * chips_per_host % target.devices:
    raise config_lib.ConfigError(
      f"--chips_per_host={chips_per_host}: the {config.data.global_batch_size} rows of {spec} do not split evenly "
      f"over hosts of that many of its {target.devices} chips."
    )
  shape = targets.mesh_shape(config.mesh, target)
  projection = step_cost.project_step(config, shape, target.chip)
  return Bar(
    spec, target.chip, target.devices, chips_per_host, config.data.global_batch_size, config.data.seq_len, projection
  )


# ---------------------------------------------------------------------------------------------------------------
# The text, the BPE and the two paths


def generate_text(directory: str, megabytes: float, files: int = 4, seed: int = 3) -> list[str]:
  """`files` text files of about `megabytes` MB in all, one document (1 to 8 stories) per line; the same bytes
  for the same arguments."""
  stream, rng = corpus.story_stream(seed), random.Random(seed)
  os.makedirs(directory, exist_ok=True)
  written = []
  for i in range(files):
    path = os.path.join(directory, f"text-{i:02d}-of-{files:02d}.txt")
    size = 0
    with open(path, "w", encoding="utf-8") as f:
      while size < megabytes * 1e6 / files:
        document = " ".join(next(stream) for _ in range(rng.randint(1, 8)))
        f.write(document + "\n")
        size += len(document.encode()) + 1
    written.append(path)
  return written


def paths_config(text_glob: str, vocab_path: str, seq_len: int, rows: int) -> ml_collections.ConfigDict:
  """The data config both paths read: one text task, the GPT-2 BPE, packed rows of seq_len, `rows` per step."""
  config = config_lib.default_config()
  data = config.data
  data.sources = ml_collections.ConfigDict({TASK: dict(kind="text", train=text_glob)})
  data.mixture = ((TASK, 1.0),)
  data.vocab.kind, data.vocab.path = "gpt2", vocab_path
  data.update(seq_len=seq_len, global_batch_size=rows, eval_batch_size=rows, pack=True)
  config.model.max_len = max(config.model.max_len, seq_len)
  config.model.vocab_size = -(-vocab.make_vocabulary(data).vocab_size // 128) * 128
  return config_lib.validate(config)


@dataclasses.dataclass
class Inputs:
  """What both paths read, and the pre-tokenized corpus written from it."""

  files: list[str]
  generated: bool
  vocab_path: str
  vocab_trained_s: float | None  # None: given
  config: ml_collections.ConfigDict  # the tokenize job's
  tokenized: ml_collections.ConfigDict  # the same, reading the corpus
  tokenize_s: float
  corpus_tokens: int
  workers: int
  peak_rss_bytes: int  # of the tokenize job: this process's (--workers=1), else the largest worker's
  base_rss_bytes: int  # this process's, before the job


def prepare(
  work_dir: str,
  input_glob: str = "",
  megabytes: float = 8.0,
  vocab_path: str = "",
  vocab_size: int = 8192,
  seq_len: int = 2048,
  rows: int = 128,
  workers: int = 1,
) -> Inputs:
  """The text (given or generated), the BPE (given or trained) and the pre-tokenized corpus, under `work_dir`."""
  from sparsetx.tools import build_vocab

  generated = not input_glob
  if generated:
    files = generate_text(os.path.join(work_dir, "text"), megabytes)
    input_glob = os.path.join(work_dir, "text", "text-*.txt")
  else:
    files = build_vocab.expand_inputs([input_glob])
  trained_s = None
  if not vocab_path:
    with timing.Stopwatch() as clock:
      vocab_path = build_vocab.build_gpt2_bpe(
        os.path.join(work_dir, "bpe"), vocab_size, inputs=files, max_documents=BPE_DOCUMENTS
      )
    trained_s = clock.seconds
  config = paths_config(input_glob, vocab_path, seq_len, rows)
  corpus_dir = os.path.join(work_dir, "tokens")
  import seqio  # noqa: F401  (imported, with TensorFlow, before the clock starts: a job's start, not its rate)

  with PeakMemory() as memory, timing.Stopwatch() as clock:
    pretokenize.tokenize_corpus(config, corpus_dir, workers=workers)
  tokenize_s = clock.seconds
  tokenized = config.copy_and_resolve_references()
  tokenized.data.tokenized_dir = corpus_dir
  tokens = token_store.TokenSplit(corpus_dir, TASK, "train").n_tokens
  peak = memory.peak if workers == 1 else memory.children_peak()
  return Inputs(
    files, generated, vocab_path, trained_s, config, tokenized, tokenize_s, tokens, workers, peak, memory.base
  )


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
  """The largest resident set of this process while the block runs (sampled every 5 ms), and of its children."""

  def __init__(self):
    self.base = self.peak = _rss_bytes()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)

  def _sample(self) -> None:
    while not self._done.wait(0.005):
      self.peak = max(self.peak, _rss_bytes())

  def __enter__(self) -> "PeakMemory":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()
    self._thread.join()
    self.peak = max(self.peak, _rss_bytes())

  @staticmethod
  def children_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # kilobytes on Linux


def read_documents(files: list[str]) -> list[str]:
  """The documents of the text files (non-blank lines, as the text source reads them)."""
  documents = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      documents.extend(line.rstrip("\n") for line in f if line.strip())
  return documents


@dataclasses.dataclass(frozen=True)
class EncodeTiming:
  documents: int
  tokens: int  # ids the tokenizer returned, without EOS
  seconds: float


def time_encode_batch(inputs: Inputs) -> EncodeTiming:
  """The raw tokenizer on the same documents, in memory: `encode_batch` on batches of ENCODE_BATCH documents."""
  tokenizer = bpe_vocab.load(inputs.vocab_path).tokenizer
  documents = read_documents(inputs.files)
  tokens = 0
  with timing.Stopwatch() as clock:
    for first in range(0, len(documents), ENCODE_BATCH):
      encodings = tokenizer.encode_batch_fast(documents[first : first + ENCODE_BATCH], add_special_tokens=False)
      tokens += sum(len(e.ids) for e in encodings)
  return EncodeTiming(len(documents), tokens, clock.seconds)


def format_tokenize_table(inputs: Inputs, raw: EncodeTiming) -> str:
  """The tokenize job's tokens/s against encode_batch's, their ratio, and the job's peak memory."""
  job_tokens = inputs.corpus_tokens - raw.documents  # the store holds an EOS per document
  job_rate, raw_rate = job_tokens / inputs.tokenize_s, raw.tokens / raw.seconds
  text_bytes = sum(os.path.getsize(f) for f in inputs.files)
  whose = "this process" if inputs.workers == 1 else "the largest worker"
  return "\n".join(
    [
      f"  {'tokenize':<44}{'s':>8}{'tokens':>14}{'tokens/s':>14}",
      f"  {f'the job (tokenize_corpus, --workers={inputs.workers})':<44}{inputs.tokenize_s:>8.2f}{job_tokens:>14,}"
      f"{job_rate:>14,.0f}",
      f"  {'encode_batch (tokenizers, in memory)':<44}{raw.seconds:>8.2f}{raw.tokens:>14,}{raw_rate:>14,.0f}",
      f"  tokenize job / encode_batch: {job_rate / raw_rate:.2f} of its tokens/s (goal: at least 0.8)",
      f"  peak resident memory of the job ({whose}): {inputs.peak_rss_bytes / 2**20:,.0f} MiB (before it: "
      f"{inputs.base_rss_bytes / 2**20:,.0f} MiB), tokenizing {text_bytes / 2**20:,.1f} MiB of text",
    ]
  )


@dataclasses.dataclass(frozen=True)
class ReadTiming:
  first_s: float  # from building the reader to its first batch
  seconds: float  # per batch, after the warm-up
  real_fraction: float  # of the rows' tokens: not padding
  tokens: int  # per batch: rows x seq_len


def open_stream(inputs: Inputs) -> global_stream.GlobalStream:
  """The stream over this process's rows (one device's sharding: a host reads its whole share)."""
  return global_stream.GlobalStream(inputs.tokenized, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def time_reads(inputs: Inputs, steps: int, warmup: int = 2) -> ReadTiming:
  """Seconds per `next_local` batch of the stream, after `warmup` batches."""
  with timing.Stopwatch() as opened:
    reader = open_stream(inputs)
  try:
    with timing.Stopwatch() as first:
      batch = reader.next_local()
    for _ in range(warmup - 1):
      reader.next_local()
    real = 0.0
    with timing.Stopwatch() as clock:
      for _ in range(steps):
        batch = reader.next_local()
        real += float(np.mean(batch["loss_weights"]))
  finally:
    reader.close()
  return ReadTiming(opened.seconds + first.seconds, clock.seconds / steps, real / steps, int(batch["targets"].size))


def format_read_table(t: ReadTiming, bar: Bar) -> str:
  """Tokens/s per host of the stream, with how many of the bar's chips and hosts that feeds."""
  chip = bar.chip.name.split()[0]
  rate = t.tokens / t.seconds
  return "\n".join(
    [
      f"  {'read':<30}{'first s':>9}{'ms/batch':>10}{'tokens/s':>14}{'real':>8}"
      f"{f'x 1 {chip}':>10}{f'x host of {bar.chips_per_host}':>13}",
      f"  {'token store (GlobalStream)':<30}{t.first_s:>9.1f}{t.seconds * 1e3:>10.1f}{rate:>14,.0f}"
      f"{t.real_fraction:>8.1%}{rate / bar.per_chip:>10.2f}{rate / bar.per_host:>13.2f}",
      f"  {f'bar: one {bar.chip.name}':<57}{bar.per_chip:>14,.0f}{'':>8}{1:>10.2f}",
      f"  {f'bar: one host of {bar.chips_per_host} {bar.chip.name}':<57}{bar.per_host:>14,.0f}",
    ]
  )


def describe(inputs: Inputs, bar: Bar, rows: int, seq_len: int, steps: int) -> str:
  """The header: the bar, the text, the BPE, the tokenizing, this machine."""
  data_bytes = sum(os.path.getsize(f) for f in inputs.files)
  documents = 0
  for path in inputs.files:
    with open(path, encoding="utf-8") as f:
      documents += sum(1 for line in f if line.strip())
  vocabulary = vocab.make_vocabulary(inputs.config.data)
  p = bar.projection
  source = "generated: corpus.story_stream" if inputs.generated else "--input"
  bpe = "given" if inputs.vocab_trained_s is None else f"trained here in {inputs.vocab_trained_s:.1f} s"
  load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return "\n".join(
    [
      f"bar: {bar.spec}, {bar.global_rows} x {bar.seq_len:,} tokens per step on {bar.devices} {bar.chip.name} in "
      f"{p.step_overlap_s * 1e3:.0f} ms (the dry run's analytic projection, overlapped: step_cost.project_step)",
      f"  one {bar.chip.name} consumes {bar.per_chip:,.0f} tokens/s; one host of {bar.chips_per_host}: "
      f"{bar.per_host:,.0f} tokens/s, {bar.host_rows} rows per step",
      f"text: {len(inputs.files)} files, {data_bytes / 1e6:.1f} MB, {documents:,} documents ({source}); "
      f"GPT-2 BPE of {vocabulary.vocab_size:,} ids ({bpe})",
      f"this host: {cpus} CPUs, load average {load}; reads: {rows} rows x {seq_len:,} tokens per batch, "
      f"{steps} batches timed after 2",
    ]
  )


def compare_store(args: SimpleNamespace) -> None:
  bar = training_bar(args.bar, args.target, args.chips_per_host)
  rows, seq_len = args.rows or bar.host_rows, args.seq_len or bar.seq_len
  with tempfile.TemporaryDirectory(prefix="sparsetx-bench-data-") as work_dir:
    inputs = prepare(work_dir, args.input, args.megabytes, args.vocab, args.vocab_size, seq_len, rows, args.workers)
    raw = time_encode_batch(inputs)
    reads = time_reads(inputs, args.steps)
    print(describe(inputs, bar, rows, seq_len, args.steps))
    print(format_tokenize_table(inputs, raw))
    print(format_read_table(reads, bar))


def absl_main(argv, holders: dict) -> None:
  del argv
  args = cli.flag_values(holders)
  try:
    if args.steps < 1 or args.rows < 0 or args.seq_len < 0 or args.megabytes <= 0:
      raise config_lib.ConfigError("--steps must be positive, --rows and --seq_len at least 0, --megabytes > 0.")
    compare_store(args)
  except (config_lib.ConfigError, ValueError) as error:
    cli.fail(error)


def main():
  """The `sparsetx-bench-data` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
