"""The analytic per-layer cost at ladder rungs: docs/kernels.md's table of HBM bytes, FLOPs and time per phase.

  sparsetx-layer-cost [--scales=2,5,8] [--types=sgatlin,fff,moe,mlp] [--tokens=32768] [--phases]

Each layer on one device at the paper's setup (own tokens per device, expert group of 8); sparsetx/plan/layer_cost.py
is the model. `--phases` also prints each layer's phase table.
"""

from absl import flags

from sparsetx import cli, hardware
from sparsetx.plan import layer_cost


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    scales=cli.define_integer_list("scales", [2, 5, 8], "Ladder scales."),
    types=flags.DEFINE_list("types", ["sgatlin", "fff", "moe", "mlp"], "Feed-forward types."),
    tokens=flags.DEFINE_integer("tokens", layer_cost.PAPER_TOKENS_PER_DEVICE, "Own tokens per device."),
    phases=flags.DEFINE_bool("phases", False, "Also print each layer's phase table."),
  )


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  rows = layer_cost.ladder_rows(tuple(args.scales), tuple(args.types), args.tokens)
  print(layer_cost.format_ladder(rows))
  if args.phases:
    for _ffn_type, scale, expert_group, cost, _ in rows:
      print(f"\nscale {scale}, expert group {expert_group}:")
      print(layer_cost.format_layer((0,), cost, hardware.chips("all")))


def main():
  """The `sparsetx-layer-cost` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
