"""The scaling ladder's table: parameters, forward FLOPs per token and the tokens a FLOP budget buys, per rung.

  sparsetx-ladder [--budget=1e18] [--seq_len=2048]

Prints every feed-forward type at scales 2..8 (sparsetx/models/ladder.py: the accounting and the sizing rules).
"""

from absl import flags

from sparsetx import cli
from sparsetx.models import ladder


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    budget=flags.DEFINE_float("budget", 1e18, "Training FLOP budget for the token column."),
    seq_len=flags.DEFINE_integer("seq_len", ladder.LADDER_SEQ_LEN, "Context length for attention FLOPs."),
  )


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  if args.budget <= 0 or args.seq_len <= 0:
    cli.fail(f"--budget={args.budget:g} and --seq_len={args.seq_len} must be positive.")
  print(ladder.format_table(ladder.ladder_table(args.budget, args.seq_len), args.budget))


def main():
  """The `sparsetx-ladder` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
