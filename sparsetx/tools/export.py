"""Export a checkpoint to the Hugging Face layout, or import an HF directory as a checkpoint.

  .venv/bin/python -m sparsetx.tools.export --workdir=workdir/pythia --out=exports/pythia (or gs://...) [--step=N]
      [--dtype=bfloat16] [--max_shard_size=5GB]
  .venv/bin/python -m sparsetx.tools.export --import_from=exports/pythia (or gs://...) --workdir=workdir/pythia-ft
      [--config=configs/pythia.py] [--max_shard_size=5GB]

More: docs/modules.md, sparsetx/tools/export.py.
"""

import json
import os

from absl import flags

from sparsetx import cli, paths
from sparsetx.config import ConfigError


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    workdir=flags.DEFINE_string("workdir", None, "Export: the training run to read. Import: the new run directory."),
    out=flags.DEFINE_string("out", None, "Export: the directory to write (must be new or empty, or --overwrite)."),
    step=flags.DEFINE_integer("step", None, "Export: the checkpoint step (default: the latest)."),
    overwrite=flags.DEFINE_bool("overwrite", False, "Replace an earlier export (or imported workdir) at the target."),
    kind=flags.DEFINE_enum(
      "kind", "auto", ["auto", "neox", "custom"], "Export: GPT-NeoX when exact (auto), or forced."
    ),
    dtype=flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Export: dtype of the saved weights."),
    max_shard_size=flags.DEFINE_string(
      "max_shard_size",
      "5GB",
      "Export: the largest safetensors shard (transformers' units: 5GB, 500MB); a tensor larger than it gets a "
      "shard of its own. Import: the parameter bytes held at once (written in groups of half of it).",
    ),
    import_from=flags.DEFINE_string("import_from", None, "Import: an HF directory to convert into a checkpoint."),
    config=cli.define_config_file("config", None, "Import: the training config (data, train) to continue with."),
  )


def absl_main(argv, holders: dict):
  del argv
  args = cli.flag_values(holders)
  from sparsetx.hf import export

  try:
    if not args.workdir:
      raise ConfigError("--workdir is required: the run to export, or the new run directory to import into.")
    if args.import_from:
      if args.out:
        raise ConfigError("--out and --import_from exclude each other: export writes --out, import writes --workdir.")
      summary = export.import_hf(
        args.import_from, args.workdir, args.overwrite, args.config, max_shard_size=args.max_shard_size
      )
      imported = args.import_from if paths.is_remote(args.import_from) else os.path.abspath(args.import_from)
      model = summary.pop("config").model.to_dict()
      print(json.dumps(dict(imported=imported, workdir=os.path.abspath(args.workdir), step=0, **summary, model=model)))
    else:
      if not args.out:
        raise ConfigError("--out is required to export: the directory to write the Hugging Face files to.")
      summary = export.export(
        args.workdir,
        args.out,
        step=args.step,
        overwrite=args.overwrite,
        kind=args.kind,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
      )
      print(json.dumps(summary, indent=1))
  except ConfigError as error:
    cli.fail(error)
  except paths.StorageError as error:  # a full disk, a quota: one line; the partial output is removed
    cli.fail(error, paths.STORAGE_EXIT_CODE)


def main():
  """The `sparsetx-export` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
