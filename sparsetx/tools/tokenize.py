"""Tokenizes config.data's tasks once into a token store that the trainer reads by row index.

  sparsetx-tokenize --config=configs/tiny.py --output_dir=DIR [--workers=N] [--shards=N] [--overwrite]
      [--ray_address=auto]

Shards run as a Ray Data pipeline (sparsetx/data/tokenize_ray.py): a local runner of --workers CPUs, or the cluster
at --ray_address, the only flag that changes between the two.

More: docs/modules.md, sparsetx/tools/tokenize.py.
"""

import os
import signal
import sys

from absl import flags, logging

from sparsetx import cli, paths
from sparsetx.config import ConfigError


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    config=cli.define_config_file(
      "config", "configs/tiny.py", "Config file, optionally with ':ARG'.", lock_config=True
    ),
    output_dir=flags.DEFINE_string(
      "output_dir", None, "Directory of the tokenized corpus (local or gs://), new or one to finish.", required=True
    ),
    workers=flags.DEFINE_integer(
      "workers",
      len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
      "Shards tokenized at a time, by Ray workers (default: this machine's CPUs; 1: in this process).",
    ),
    ray_address=flags.DEFINE_string(
      "ray_address", "", "A Ray cluster to run on ('auto', 'ray://HEAD:10001'); empty: a local Ray runner."
    ),
    shards=flags.DEFINE_integer("shards", 0, "Shards per split; 0: one per input file, at least --workers."),
    overwrite=flags.DEFINE_bool("overwrite", False, "Replace a corpus in --output_dir tokenized with another config."),
  )


class ConsoleProgress:
  """One progress line: rewritten in place on a terminal, else logged every `interval` seconds and at the end."""

  def __init__(self, output_dir: str, interval: float = 10.0):
    self._output_dir = output_dir
    self._tty, self._interval, self._last = sys.stderr.isatty(), interval, -float("inf")

  def __call__(self, progress) -> None:
    if self._last == -float("inf"):
      logging.info(
        "tokenizing %d shards into %s (%d already complete)",
        progress.shards_total - progress.shards_skipped,
        self._output_dir,
        progress.shards_skipped,
      )
      self._last = progress.seconds
      return
    line = (
      f"shards {progress.shards_done}/{progress.shards_total}  documents {progress.documents:,}  "
      f"tokens {progress.tokens:,}  {progress.tokens_per_second:,.0f} tokens/s"
    )
    if self._tty:
      sys.stderr.write(f"\r{line}\033[K" + ("\n" if progress.final else ""))
      sys.stderr.flush()
    elif progress.final or progress.seconds - self._last >= self._interval:
      self._last = progress.seconds
      logging.info("%s", line)


def _stop(signum, frame) -> None:
  raise KeyboardInterrupt


def absl_main(argv, holders: dict):
  del argv  # words that are no flags: refused by cli.run
  args = cli.flag_values(holders)
  if not flags.FLAGS["verbosity"].present:  # TensorFlow's C++ warnings repeat, with tracebacks, what fails here
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from sparsetx.data import pretokenize

  signal.signal(signal.SIGTERM, _stop)  # the workers stop with this process; a rerun resumes
  progress = ConsoleProgress(args.output_dir)
  try:
    manifest = pretokenize.tokenize_corpus(
      args.config,
      args.output_dir,
      workers=args.workers,
      shards=args.shards,
      overwrite=args.overwrite,
      progress=progress,
      ray_address=args.ray_address,
    )
  except (ConfigError, pretokenize.ShardError) as error:
    cli.fail(error)
  except paths.StorageError as error:  # a full disk, a quota: one line, the complete shards kept
    cli.fail(error, paths.STORAGE_EXIT_CODE)
  except KeyboardInterrupt:
    cli.fail(f"interrupted; run the same command again to finish {args.output_dir} (complete shards are kept).", 130)
  counts = ", ".join(
    f"{task} ({', '.join(f'{s}: {n}' for s, n in splits.items())})" for task, splits in manifest["tasks"].items()
  )
  logging.info("wrote %s: shards of %s", args.output_dir, counts)


def main():
  """The `sparsetx-tokenize` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
