"""Benchmark the whole train step per feed-forward type, side by side: tokens/s and MFU on one rung.

Every type is built at the same ladder rung (configs/ladder.py:TYPE,SCALE) with the same batch,
sequence length, dtype and mesh (all local devices on the data axis), so the table compares what a
user would train. All steps are compiled first, then timed in interleaved rounds (one step of each
type per round, so drift and noise hit every type alike); the table prints medians and ratios to the
first type. MFU = the ladder's model FLOPs per step (3 x forward, sparsetx/models/ladder.py) / (step
time x devices x peak bf16 FLOP/s of the chip, sparsetx/parallel/hardware.py); on a chip the table
does not hold (a CPU) MFU is n/a unless --peak_tflops gives the peak.

  .venv/bin/python -m sparsetx.tools.bench_train_step                   # GPU / TPU: scale 2, 8 x 512 tokens, bf16
  .venv/bin/python -m sparsetx.tools.bench_train_step --small           # CPU: scale 1 cut to 2 layers, 8 x 64, float32
  .venv/bin/python -m sparsetx.tools.bench_train_step --types=mlp,sgatlin,fff --scale=4 --batch=32 --seq_len=2048
"""

import statistics
import time
from types import SimpleNamespace

import jax
import numpy as np
from absl import flags

from sparsetx import cli
from sparsetx import config as config_lib
from sparsetx.models import ladder
from sparsetx.parallel import expert_parallel, hardware
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib


def rung_config(ffn_type: str, args) -> config_lib.ml_collections.ConfigDict:
  """The ladder rung of `ffn_type` with the benchmark's batch, length and dtype (and --small's cuts)."""
  config = config_lib.default_config()
  config.model = ladder.ladder_model_config(args.scale, ffn_type)
  config.model.update(dtype=args.dtype, max_len=max(config.model.max_len, args.seq_len))
  if args.small:
    config.model.update(n_layers=2, vocab_size=512)
  config.data.update(seq_len=args.seq_len, global_batch_size=args.batch, eval_batch_size=args.batch)
  config.train.update(steps=1000, warmup_steps=10)
  return config_lib.validate(config)


class TypeStep:
  """One type's compiled train step, its state and a fixed batch; times one step at a time."""

  def __init__(self, ffn_type: str, args, devices):
    self.name = ffn_type
    config = self.config = rung_config(ffn_type, args)
    built = state_lib.setup(config, devices)
    B, T = args.batch, args.seq_len
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32)
    batch = dict(
      inputs=tokens[:, :-1],
      targets=tokens[:, 1:],
      segment_ids=np.ones((B, T), np.int32),
      positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)),
      loss_weights=np.ones((B, T), np.float32),
    )
    self.batch = jax.device_put(batch, built.batch_sharding)
    with expert_parallel.activate(built.mesh, config.mesh.rules):
      self.state = state_lib.create_state(config, built.shardings, built.model, built.tx)
      start = time.perf_counter()
      self.step = step_lib.make_train_step(config, built).lower(self.state, self.batch).compile()
      self.compile_s = time.perf_counter() - start
    self.tokens = B * T
    self.model_flops = 3 * ladder.forward_flops_per_token(config.model, T)["total"] * self.tokens
    self.params = ladder.param_counts(config.model)
    self.times = []
    self.run()  # the first call also moves what a first call moves

  def run(self) -> float:
    start = time.perf_counter()
    self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready(metrics["loss"])
    return time.perf_counter() - start

  def time_once(self):
    self.times.append(self.run())

  @property
  def seconds(self) -> float:
    return statistics.median(self.times)


_FLAGS = dict(
  types=flags.DEFINE_list("types", list(config_lib.FFN_TYPES), "Feed-forward types; the first one is the baseline."),
  scale=flags.DEFINE_integer("scale", None, "Ladder rung (default 2; 1 with --small)."),
  batch=flags.DEFINE_integer("batch", 8, "Sequences per step."),
  seq_len=flags.DEFINE_integer("seq_len", None, "Default 512; 64 with --small."),
  dtype=flags.DEFINE_string("dtype", None, "Default bfloat16; float32 with --small (what a CPU runs fast)."),
  rounds=flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (median)."),
  small=flags.DEFINE_bool("small", False, "A CPU-sized shape: scale 1, 2 layers, vocab 512, 8 x 64."),
  peak_tflops=flags.DEFINE_float("peak_tflops", None, "Peak bf16 TFLOP/s per device for MFU."),
)


def absl_main(argv):
  del argv
  args = SimpleNamespace(**{name: holder.value for name, holder in _FLAGS.items()})
  args.scale = args.scale or (1 if args.small else 2)
  args.seq_len = args.seq_len or (64 if args.small else 512)
  args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
  devices = jax.devices()
  chip = hardware.chip_of(devices[0].device_kind)
  peak = args.peak_tflops * 1e12 if args.peak_tflops else chip.peak_flops if chip else None
  print(
    f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind}"
    + (f" (peak {peak / 1e12:.0f} TFLOP/s per device)" if peak else " (no peak known: MFU n/a)")
  )
  try:
    steps = [TypeStep(t, args, devices) for t in args.types]
  except config_lib.ConfigError as error:
    cli.fail(error)
  for _ in range(args.rounds):
    for s in steps:
      s.time_once()
  small = ", --small: 2 layers, vocab 512" if args.small else ""
  print(
    f"\ntrain step, ladder scale {args.scale} (d_model {128 * args.scale}{small}), {args.batch} x {args.seq_len} tokens, "
    f"{args.dtype}; median of {args.rounds} interleaved rounds; ratios to {steps[0].name}"
  )
  print(
    f"{'type':<9}{'total params':>14}{'active':>12}{'compile s':>11}{'step ms':>10}{'tokens/s':>12}"
    f"{'x ' + steps[0].name:>10}{'model TFLOP/s':>15}{'MFU':>8}"
  )
  base = steps[0].tokens / steps[0].seconds
  for s in steps:
    rate = s.tokens / s.seconds
    tflops = s.model_flops / s.seconds / 1e12
    mfu = f"{s.model_flops / (s.seconds * len(devices) * peak):.1%}" if peak else "n/a"
    print(
      f"{s.name:<9}{s.params['total']:>14,}{s.params['active']:>12,}{s.compile_s:>11.1f}{1e3 * s.seconds:>10.1f}"
      f"{rate:>12,.0f}{rate / base:>10.2f}{tflops:>15.3f}{mfu:>8}"
    )


def main():
  """The `sparsetx-bench-train-step` entry point."""
  cli.run(absl_main)


if __name__ == "__main__":
  main()
