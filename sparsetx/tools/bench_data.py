"""Input pipeline throughput against what a train step consumes, measured side by side.

  python -m sparsetx.tools.bench_data [--config=configs/tiny.py] [--steps=200] [--train_steps=10]

Prints one table: tokens/s of the pipeline (host batches, and global jax.Arrays on the mesh),
the fraction of real (non-padding) tokens, and tokens/s of a jitted forward+backward of the
model on the same batch shape, with their ratio. The goal is a pipeline at least 10x faster
than the step, so input never limits training. The data seq_len is set to the model's
max_len (the tiny model's context).
"""

import importlib.util
import os
import time
from types import SimpleNamespace

# Eight simulated CPU devices for the mesh, fixed before jax is imported (a real accelerator ignores it).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from sparsetx import cli  # noqa: E402
from sparsetx import config as config_lib  # noqa: E402
from sparsetx.data import pipeline  # noqa: E402
from sparsetx.models.transformer import Transformer  # noqa: E402

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


def time_train_step(config, batch, steps: int) -> float:
  """Seconds per jitted forward+backward+AdamW update on `batch`."""
  model = Transformer(ml_collections.FrozenConfigDict(config.model))
  params = model.init(jax.random.key(0), batch["inputs"][:1], batch["positions"][:1], batch["segment_ids"][:1])
  optimizer = optax.adamw(1e-3)
  opt_state = optimizer.init(params)

  def loss_fn(params, batch):
    logits_BTV = model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    return jnp.sum(losses_BT * batch["loss_weights"]) / jnp.maximum(jnp.sum(batch["loss_weights"]), 1.0)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state, loss = step(params, opt_state, batch)  # compile
  jax.block_until_ready(loss)
  start = time.perf_counter()
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, batch)
  jax.block_until_ready(loss)
  return (time.perf_counter() - start) / steps


def absl_main(argv) -> None:
  del argv
  args = SimpleNamespace(**{name: holder.value for name, holder in _FLAGS.items()})
  config = load_config(args.config)
  data = config.data
  mesh = Mesh(np.array(jax.devices()), ("data",))
  sharding = NamedSharding(mesh, P("data", None))
  tokens = data.global_batch_size * data.seq_len

  start = time.perf_counter()
  iterator = pipeline.make_train_iterator(config, sharding)
  build_s = time.perf_counter() - start
  host_s, real_fraction = time_pipeline(iterator, args.steps, global_arrays=False)
  global_s, _ = time_pipeline(iterator, args.steps, global_arrays=True)
  step_s = time_train_step(config, next(iterator), args.train_steps)

  print(
    f"config {args.config}  mixture {dict(data.mixture)}  batch {data.global_batch_size} x {data.seq_len}"
    f"  ffn {config.model.ffn.type}  devices {jax.device_count()} x {jax.devices()[0].platform}"
  )
  print(f"pipeline built in {build_s:.1f} s; real (non-padding) tokens: {real_fraction:.1%}")
  print(f"{'stage':<36}{'ms/batch':>10}{'tokens/s':>14}{'x train step':>14}")
  rows = (
    ("pipeline, host batches", host_s),
    ("pipeline, global jax.Arrays", global_s),
    ("train step (fwd+bwd+AdamW)", step_s),
  )
  for name, seconds in rows:
    print(f"{name:<36}{seconds * 1e3:>10.2f}{tokens / seconds:>14,.0f}{step_s / seconds:>14.1f}")


def main():
  """The `sparsetx-bench-data` entry point."""
  cli.run(absl_main)


if __name__ == "__main__":
  main()
