"""Benchmark the whole train step per feed-forward type, side by side: tokens/s and MFU on one rung.

More: docs/modules.md, sparsetx/tools/bench_train_step.py.
"""

import jax
from absl import flags

from sparsetx import cli
from sparsetx import config as config_lib
from sparsetx.measure import step_bench


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  rung = step_bench.define_rung_flags()
  flags.adopt_module_key_flags(step_bench)  # --help lists them with the program's own
  return dict(
    types=flags.DEFINE_list("types", list(config_lib.FFN_TYPES), "Feed-forward types; the first one is the baseline."),
    rounds=flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (median)."),
    peak_tflops=flags.DEFINE_float("peak_tflops", None, "Peak bf16 TFLOP/s per device for MFU."),
    bad_steps=flags.DEFINE_list(
      "bad_steps",
      ["stop"],
      "config.train.bad_steps modes, each type's step under each (e.g. stop,skip: the cost of the skip decision).",
    ),
    usage_counts=flags.DEFINE_list(
      "usage_counts",
      ["on"],
      "on,off: each type's step with and without the window's usage counts in its state (their cost).",
    ),
    compiled_for=flags.DEFINE_list(
      "compiled_for",
      [],
      "With --usage_counts=on,off: topologies (h100:1x1x4, v5p:2x2x1) whose compiled step, with and without the "
      "counts, gives the bytes it accesses and its collectives (each type's rung, data over every device).",
    ),
    **rung,
  )


def absl_main(argv, holders: dict):
  del argv
  args = step_bench.with_defaults(cli.flag_values(holders))
  devices = jax.devices()
  peak = step_bench.peak_flops(args, devices)
  print(
    f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind}"
    + (f" (peak {peak / 1e12:.0f} TFLOP/s per device)" if peak else " (no peak known: MFU n/a)")
  )
  try:
    steps = step_bench.measure(args, devices)
  except config_lib.ConfigError as error:
    cli.fail(error)
  small = ", --small: 2 layers, vocab 512" if args.small else ""
  print(
    f"\ntrain step, ladder scale {args.scale} (d_model {128 * args.scale}{small}), {args.batch} x {args.seq_len} tokens, "
    f"{args.dtype}, {step_bench.step_words(steps[0].config)}; median of {args.rounds} interleaved rounds; "
    f"ratios to {steps[0].name}"
  )
  print(
    f"{'type':<20}{'total params':>14}{'active':>12}{'compile s':>11}{'step ms':>10}{'tokens/s':>12}"
    f"{'x ' + steps[0].name:>10}{'model TFLOP/s':>15}{'MFU':>8}"
  )
  base = steps[0].tokens / steps[0].seconds
  for s in steps:
    rate = s.tokens / s.seconds
    tflops = s.model_flops / s.seconds / 1e12
    mfu = f"{s.model_flops / (s.seconds * len(devices) * peak):.1%}" if peak else "n/a"
    print(
      f"{s.name:<20}{s.params['total']:>14,}{s.params['active']:>12,}{s.compile_s:>11.1f}{1e3 * s.seconds:>10.1f}"
      f"{rate:>12,.0f}{rate / base:>10.2f}{tflops:>15.3f}{mfu:>8}"
    )
  if args.compiled_for:
    print_compiled_usage_cost(args)


def print_compiled_usage_cost(args) -> None:
  """What the usage counts add to the compiled step, per type and topology: the compiler's bytes accessed and
  device memory (arguments + temporaries), and the collectives with their bytes."""
  print("\ncompiled step, usage counts on / off: bytes accessed, device memory, collectives (count, MB)")
  for ffn_type in args.types:
    config = step_bench.rung_config(ffn_type, args)
    for topology_name in args.compiled_for:
      on, off = step_bench.compiled_usage_cost(config, topology_name).values()
      memory = [sum(r.memory[k] for k in ("argument", "temp")) / 1e6 for r in (on, off)]
      wire = [sum(c.nbytes for c in r.collectives) / 1e6 for r in (on, off)]
      print(
        f"{ffn_type:<10}{topology_name:<12} accessed {on.bytes_accessed / 1e9:.4f} / {off.bytes_accessed / 1e9:.4f} GB"
        f"  memory {memory[0]:.2f} / {memory[1]:.2f} MB  collectives {len(on.collectives)} / "
        f"{len(off.collectives)} ({wire[0]:.3f} / {wire[1]:.3f} MB)"
      )


def main():
  """The `sparsetx-bench-train-step` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
