"""Input pipeline throughput against what a train step consumes, measured side by side.

  python -m sparsetx.tools.bench_data [--config=configs/tiny.py] [--steps=200] [--train_steps=10]

Prints one table: tokens/s of the pipeline (host batches, and global jax.Arrays on the mesh),
the fraction of real (non-padding) tokens, and tokens/s of the train step as `make train` runs
it (the config's mesh on this machine's devices, no simulated ones; the trainer's own jitted step,
sparsetx/train/step.py), with their ratio. The goal is a pipeline at least 10x faster than the
step, so input never limits training. The data seq_len is set to the model's max_len (the tiny
model's context).
"""

import importlib.util
import os
import time
from types import SimpleNamespace

import jax
import ml_collections
import numpy as np
from absl import flags

from sparsetx import cli
from sparsetx import config as config_lib
from sparsetx.data import pipeline
from sparsetx.parallel import expert_parallel
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib

_FLAGS = dict(
  config=flags.DEFINE_string("config", "configs/tiny.py", "Config file, optionally with ':ARG'."),
  steps=flags.DEFINE_integer("steps", 200, "Pipeline batches timed."),
  train_steps=flags.DEFINE_integer("train_steps", 10, "Train steps timed."),
)


def load_config(spec: str) -> ml_collections.ConfigDict:
  """get_config([ARG]) of the file 'path[:ARG]', a path relative to the working directory (the repository root)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    cli.fail(
      f"--config={spec}: no such file (relative paths start from {os.getcwd()}); give one such as configs/tiny.py."
    )
  module_spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg) if arg else module.get_config()
  config.data.seq_len = config.model.max_len
  return config_lib.validate(config)


def time_pipeline(iterator, steps: int, global_arrays: bool) -> tuple[float, float]:
  """Seconds per batch and fraction of real tokens, after two warm-up batches."""
  fetch = (lambda: next(iterator)) if global_arrays else iterator.next_local
  for _ in range(2):
    fetch()
  real = 0.0
  start = time.perf_counter()
  for _ in range(steps):
    batch = fetch()
    if global_arrays:
      jax.block_until_ready(batch)
    real += float(np.mean(np.asarray(batch["loss_weights"])))
  return (time.perf_counter() - start) / steps, real / steps


def time_train_step(config, built: state_lib.Setup, batch, steps: int) -> float:
  """Seconds per step of the trainer's jitted train step (forward, backward, optimizer) on `batch`, after the
  compiling first one: what the training loop runs."""
  with expert_parallel.activate(built.mesh, config.mesh.rules):
    state = state_lib.create_state(config, built.shardings, built.model, built.tx)
    step = step_lib.make_train_step(config, built)
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics["loss"])
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
  return (time.perf_counter() - start) / steps


def absl_main(argv) -> None:
  del argv
  args = SimpleNamespace(**{name: holder.value for name, holder in _FLAGS.items()})
  config = load_config(args.config)
  data = config.data
  built = state_lib.setup(config)  # the trainer's mesh on this machine's devices
  tokens = data.global_batch_size * data.seq_len

  start = time.perf_counter()
  iterator = pipeline.make_train_iterator(config, built.batch_sharding)
  build_s = time.perf_counter() - start
  host_s, real_fraction = time_pipeline(iterator, args.steps, global_arrays=False)
  global_s, _ = time_pipeline(iterator, args.steps, global_arrays=True)
  step_s = time_train_step(config, built, next(iterator), args.train_steps)

  print(
    f"config {args.config}  mixture {dict(data.mixture)}  batch {data.global_batch_size} x {data.seq_len}"
    f"  ffn {config.model.ffn.type}  devices {jax.device_count()} x {jax.devices()[0].platform}"
  )
  print(f"pipeline built in {build_s:.1f} s; real (non-padding) tokens: {real_fraction:.1%}")
  print(f"{'stage':<36}{'ms/batch':>10}{'tokens/s':>14}{'x train step':>14}")
  rows = (
    ("pipeline, host batches", host_s),
    ("pipeline, global jax.Arrays", global_s),
    ("train step (as the trainer runs it)", step_s),
  )
  for name, seconds in rows:
    print(f"{name:<36}{seconds * 1e3:>10.2f}{tokens / seconds:>14,.0f}{step_s / seconds:>14.1f}")


def main():
  """The `sparsetx-bench-data` entry point."""
  cli.run(absl_main)


if __name__ == "__main__":
  main()
