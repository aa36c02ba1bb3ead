"""Sparse fine-tuning from a dense checkpoint: swap its feed-forward layers for FFF or sgatlin.

  python -m sparsetx.tools.sparsify --source=workdir/dense --workdir=workdir/fff_ft --config=configs/tiny.py:fff       [--config.model.ffn.depth=6] [--config.model.ffn_layers=1,3] [--overwrite]
  python -m sparsetx.tools.sparsify --from_hf=path/to/gpt_neox_dir --workdir=... --config=configs/pythia.py:... [overrides]
  python -m sparsetx.train --workdir=workdir/fff_ft --config=configs/tiny.py:fff [the same overrides]       [--config.train.freeze_steps=100]

More: docs/modules.md, sparsetx/tools/sparsify.py.
"""

from absl import flags

from sparsetx import cli
from sparsetx.config import ConfigError


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    config=cli.define_config_file(
      "config", "configs/tiny.py:fff", "Target config file, optionally ':ARG'.", lock_config=True
    ),
    source=flags.DEFINE_string("source", None, "A sparsetx workdir holding the dense checkpoint to start from."),
    from_hf=flags.DEFINE_string("from_hf", None, "Instead of --source: an HF GPT-NeoX (or sparsetx export) directory."),
    source_step=flags.DEFINE_integer("source_step", None, "The source checkpoint's step (default: its latest)."),
    workdir=flags.DEFINE_string("workdir", None, "The new workdir the step-0 checkpoint is written to.", required=True),
    overwrite=flags.DEFINE_bool(
      "overwrite", False, "Replace a run already in --workdir (its checkpoints and metrics)."
    ),
  )


def _dense_ffn_flags(wanted, given) -> list[str]:
  """The --config.model.dense_ffn.* flags the trainer needs: the kept layers' fields that differ from --config."""
  return [
    f"--config.model.dense_ffn.{key}={value}"
    for key, value in sorted(wanted.items())
    if not isinstance(value, dict) and given.get(key) != value
  ]


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  from sparsetx import config as config_lib
  from sparsetx import sparsify

  try:
    if bool(args.source) == bool(args.from_hf):
      raise ConfigError("give exactly one source: --source=WORKDIR (a sparsetx checkpoint) or --from_hf=DIR.")
    given = args.config
    if args.from_hf:
      config, report = sparsify.sparsify_hf(args.from_hf, given, args.workdir, args.overwrite)
    else:
      config, report = sparsify.sparsify_checkpoint(args.source, given, args.workdir, args.overwrite, args.source_step)
  except ConfigError as error:
    cli.fail(error)
  print(sparsify.format_report(report))
  print(f"swapped layers: {report['swapped_layers']}; report: {args.workdir}/{sparsify.REPORT_FILE}")
  extra = []
  if config_lib.is_mixed(config.model):
    extra = _dense_ffn_flags(config.model.dense_ffn.to_dict(), given.model.dense_ffn.to_dict())
  print(
    "Train on with the same --config and overrides"
    + (", plus " + " ".join(extra) if extra else "")
    + f": python -m sparsetx.train --workdir={args.workdir} --config=... [--config.train.freeze_steps=N]"
  )


def main():
  """The `sparsetx-sparsify` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
