"""Benchmark where one compiled train step's device time goes, per feed-forward type side by side: attention, the
sparse layers' router and top-k, row gathers, table gradients (sort, segment sums, combine), the dense feed-forward,
loss and LM head, the optimizer, the rest. Read from a `jax.profiler` trace of the step (perf/step_parts.py); with
--topology, from the step compiled here for that machine (what each part launches and moves, no timing).

More: docs/modules.md, sparsetx/tools/bench_step_parts.py.
"""

import tempfile

import jax
from absl import flags

from sparsetx import cli
from sparsetx import config as config_lib
from sparsetx.measure import aot, step_bench
from sparsetx.perf import step_parts


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  rung = step_bench.define_rung_flags()
  flags.adopt_module_key_flags(step_bench)  # --help lists them with the program's own
  return dict(
    types=flags.DEFINE_list("types", ["mlp", "sgatlin"], "Feed-forward types; the first one is the baseline."),
    rounds=flags.DEFINE_integer("rounds", 3, "Traced steps per type (the means of their spans and parts)."),
    **rung,
    topology=flags.DEFINE_string(
      "topology", None, "Compile for this machine here (h200:1x1x1, h100:1x1x8, v5p:2x2x1) and read the program."
    ),
  )


def breakdown(step: step_bench.TypeStep, rounds: int) -> step_parts.Breakdown:
  """Traces `rounds` runs of a compiled TypeStep (after one untraced run) and reads its parts."""
  jax.block_until_ready(step())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(rounds):
        jax.block_until_ready(step())
    return step_parts.read_trace(trace_dir, step.step.as_text(), "jit_train_step", rounds)


def format_table(names, breakdowns) -> str:
  """Milliseconds and shares per part, one column pair per type; then the parts' sum (the time any op ran) and a
  run's span (first op to last)."""
  header = f"{'part':<28}" + "".join(f"{name + ' ms':>14}{'share':>8}" for name in names)
  lines = [header]
  for part in step_parts.PARTS:
    cells = "".join(f"{1e3 * b.parts_s[part]:>14.2f}{b.parts_s[part] / b.busy_s:>8.1%}" for b in breakdowns)
    lines.append(f"{part:<28}{cells}")
  lines.append(f"{'sum of parts':<28}" + "".join(f"{1e3 * b.busy_s:>14.2f}{'':>8}" for b in breakdowns))
  lines.append(f"{'step (span of a run)':<28}" + "".join(f"{1e3 * b.step_s:>14.2f}{'':>8}" for b in breakdowns))
  base = breakdowns[0].step_s
  lines.append(f"{'x ' + names[0]:<28}" + "".join(f"{b.step_s / base:>14.2f}{'':>8}" for b in breakdowns))
  return "\n".join(lines)


def format_compiled_table(names, programs) -> str:
  """Kernels launched and GB handed in / returned per part of one step, one column group per type."""
  header = f"{'part':<28}" + "".join(f"{name + ' kernels':>16}{'GB in':>8}{'GB out':>8}" for name in names)
  lines = [header]
  for part in (*step_parts.PARTS, None):
    cells = [p[part] if part else step_parts.CompiledPart(*map(sum, zip(*p.values()))) for p in programs]
    lines.append(
      f"{part or 'step':<28}"
      + "".join(f"{c.kernels:>16}{c.operand_bytes / 1e9:>8.2f}{c.result_bytes / 1e9:>8.2f}" for c in cells)
    )
  return "\n".join(lines)


def compiled_main(args):
  """--topology: each type's step compiled for that machine on this one, read by part (no device runs it)."""
  try:
    configs = [step_bench.rung_config(name, args) for name in args.types]
    programs = [aot.compile_for_topology(config, args.topology)[0].as_text() for config in configs]
  except config_lib.ConfigError as error:
    cli.fail(error)
  print(
    f"jax {jax.__version__}, compiled for {args.topology} on this machine (not run): ladder scale {args.scale}, "
    f"{args.batch} x {args.seq_len} tokens, {args.dtype}, {step_bench.step_words(configs[0])}; per step, "
    "kernels launched and the bytes they are handed (a gathered table once) and return"
  )
  print(format_compiled_table(args.types, [step_parts.compiled_parts(text) for text in programs]))


def absl_main(argv, holders: dict):
  del argv
  args = step_bench.with_defaults(cli.flag_values(holders))
  if args.topology:
    return compiled_main(args)
  devices = jax.devices()[:1]
  try:
    steps = [step_bench.TypeStep(name, args, devices) for name in args.types]
  except config_lib.ConfigError as error:
    cli.fail(error)
  try:
    results = [breakdown(step, args.rounds) for step in steps]
  except step_parts.TraceError as error:  # a device whose trace this reader does not know: no table, one line
    cli.fail(f"reading the traced steps: {error}", code=1)
  print(
    f"jax {jax.__version__} on {devices[0].device_kind}: ladder scale {args.scale}, {args.batch} x {args.seq_len} "
    f"tokens, {args.dtype}, {step_bench.step_words(steps[0].config)}, {args.rounds} traced steps per "
    "type (device time of each part per step)"
  )
  print(format_table(args.types, results))


def main():
  """The `sparsetx-bench-step-parts` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
