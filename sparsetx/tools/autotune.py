"""sparsetx-autotune: the device picks its kernels for a config's train step, and the autotune table keeps them.

  python -m sparsetx.tools.autotune --config=configs/ladder.py:sgatlin,4 --config.data.global_batch_size=16

For each kernel call the step makes, every implementation this device runs is timed (a child process each; on a
TPU in this process) and checked against XLA's values and gradients; the fastest correct one goes into the autotune
table with the reason each other was dropped (--again: held calls too; --budget_s: stop measuring after that many
seconds). An unreadable or unwritable table is one `error:` line.

More: docs/modules.md, sparsetx/tools/autotune.py.
"""

from absl import flags

from sparsetx import cli, paths
from sparsetx import config as config_lib
from sparsetx.kernels import autotune_table
from sparsetx.kernels.device import target
from sparsetx.kernels.options import options_from_config
from sparsetx.plan import autotune
from sparsetx.train import state as state_lib
from sparsetx.train import step_kernels


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    config=cli.define_config_file("config", "configs/tiny.py", "Config file, optionally with ':ARG'."),
    again=flags.DEFINE_bool("again", False, "Measure the shapes the table already holds too."),
    rounds=flags.DEFINE_integer("rounds", 5, "Timed runs per implementation (their median)."),
    implementations=flags.DEFINE_list(
      "implementations",
      None,
      "Measure only these (registry names, e.g. triton,xla, or a tiling: triton@block_tokens=16); default: all this "
      "device runs.",
    ),
    budget_s=flags.DEFINE_float(
      "budget_s",
      None,
      "Stop measuring after this many seconds: the calls left are named in one line and `auto` takes the default "
      "order for them (default: no limit).",
    ),
    tilings=flags.DEFINE_bool(
      "tilings",
      False,
      "Also measure each implementation's offered tilings (kernels/registry.py; a child process each) beside the "
      "config's.",
    ),
  )


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  try:
    if args.budget_s is not None and not args.budget_s >= 0:
      raise config_lib.ConfigError(f"--budget_s={args.budget_s} must be >= 0 seconds (omit it for no limit).")
    config = config_lib.validate(holders["config"].value)
    options = options_from_config(config.model.ffn.kernel)
    calls = step_kernels.step_calls(config, state_lib.setup(config))
    todo = calls if args.again else autotune.missing(calls, options)
    summary = autotune.summary(calls, todo, options, args.again)
    print(f"autotune on {target().device_kind}: {summary}; table {autotune_table.path()}")
    if todo:
      autotune.ready_to_measure()
    report = lambda line: print("  " + line.removeprefix("autotune: "))  # noqa: E731
    autotune.tune_all(todo, options, report, args.budget_s, args.implementations, args.rounds, args.tilings)
  except config_lib.ConfigError as error:
    cli.fail(error)
  except paths.StorageError as error:
    cli.fail(error, paths.STORAGE_EXIT_CODE)


def main():
  """The `sparsetx-autotune` entry point."""
  autotune.leave_device_memory_to_children()  # before JAX starts
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
