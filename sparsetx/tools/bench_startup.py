"""Time to the first step, cold against warm: `python -m sparsetx.tools.bench_startup [--models=tiny,sgatlin2]`.

Each model's corpus is tokenized once; then `sparsetx-train` starts twice in new workdirs on one compilation cache
(config.train.compilation_cache_dir): first empty (cold), then as the first left it (warm, as a restart finds it).
The times are the trainer's own (metrics.jsonl's startup/ row): from its start to the end of the first step, and the
first step's compile. One table, side by side.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import flags

from sparsetx import cli
from sparsetx.config import ConfigError

MODELS = {
  "tiny": ["--config=configs/tiny.py"],
  # The ladder's sgatlin rung 2 (d_model 256, 4 layers, 16 channels of 40**2 neurons, top 8, d_key 128) on tiny's data.
  "sgatlin2": [
    "--config=configs/tiny.py:sgatlin",
    "--config.model.d_model=256",
    "--config.model.ffn.d_ffw=1600",
    "--config.model.ffn.n_channels=16",
    "--config.model.ffn.d_key=128",
  ],
}


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    models=flags.DEFINE_list("models", list(MODELS), f"Which to start: {', '.join(MODELS)}."),
    scratch=flags.DEFINE_string("scratch", None, "Directory for the corpora, workdirs and caches (default: a temp)."),
  )


def _run(command: list[str], what: str) -> None:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the config's cache, nothing else
  result = subprocess.run([sys.executable, "-m", *command], env=env, capture_output=True, text=True)
  if result.returncode:
    raise RuntimeError(f"{what} failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}")


def startup(workdir: str) -> dict:
  """The trainer's startup/ row of metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return next(row for row in map(json.loads, f) if "startup/compile_seconds" in row)


def measure(name: str, scratch: str) -> dict:
  """{cold, warm}: each start's startup/ row."""
  flags_ = MODELS[name]
  corpus, cache = os.path.join(scratch, name, "tokenized"), os.path.join(scratch, name, "cache")
  _run(["sparsetx.tools.tokenize", flags_[0], *flags_[1:], f"--output_dir={corpus}"], f"tokenizing {name}")
  rows = {}
  for start in ("cold", "warm"):
    workdir = os.path.join(scratch, name, start)
    overrides = [
      f"--workdir={workdir}",
      f"--config.data.tokenized_dir={corpus}",
      f"--config.train.compilation_cache_dir={cache}",
      "--config.train.steps=2",
      "--config.train.eval_every=1000",
      "--config.train.eval_batches=1",
      "--config.checkpoint.every=1000",
    ]
    _run(["sparsetx.train", *flags_, *overrides], f"the {start} start of {name}")
    rows[start] = startup(workdir)
  return rows


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  unknown = [m for m in args.models if m not in MODELS]
  if unknown:
    cli.fail(ConfigError(f"--models={','.join(args.models)}: {unknown[0]!r} is unknown; use {', '.join(MODELS)}."))
  scratch = args.scratch or tempfile.mkdtemp(prefix="bench_startup_")
  print(f"time to the first step, cold (empty compilation cache) and warm (the cache the cold start left); {scratch}")
  print(f"{'model':<10}{'cold s':>9}{'compile':>9}{'warm s':>9}{'compile':>9}{'warm/cold compile':>19}")
  for name in args.models:
    rows = measure(name, scratch)
    cold, warm = rows["cold"], rows["warm"]
    print(
      f"{name:<10}{cold['startup/first_step_seconds']:>9.1f}{cold['startup/compile_seconds']:>9.1f}"
      f"{warm['startup/first_step_seconds']:>9.1f}{warm['startup/compile_seconds']:>9.1f}"
      f"{warm['startup/compile_seconds'] / cold['startup/compile_seconds']:>19.2f}",
      flush=True,
    )


def main():
  """The `sparsetx-bench-startup` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
