"""Export a checkpoint to the Hugging Face layout, or import an HF directory as a checkpoint.

  .venv/bin/python -m sparsetx.tools.export --workdir=workdir/pythia --out=exports/pythia [--step=N] [--dtype=bfloat16]
  .venv/bin/python -m sparsetx.tools.export --import_from=exports/pythia --workdir=workdir/pythia-ft [--config=configs/pythia.py]

Export writes model.safetensors, config.json, generation_config.json and the tokenizer files
(plus the bundled modeling files for sparse models). `--kind=auto` exports dense GPT-NeoX-block
models as plain GPTNeoXForCausalLM and every other architecture as a custom model loaded with
`trust_remote_code=True`; `--kind=neox` insists on the former. Import writes a step-0 checkpoint
(params, fresh optimizer state, the data stream's start) that `python -m sparsetx.train` continues;
--config supplies the data and train sections (its model must be the imported one). A directory
that already holds files is replaced only with --overwrite. Errors (a bad flag or --config, a missing or
damaged checkpoint) print one `error:` line; exit code 2.
"""

import json
import os

from absl import flags

from sparsetx import cli
from sparsetx.config import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "Export: the training run to read. Import: the new run directory.")
_OUT = flags.DEFINE_string("out", None, "Export: the directory to write (must be new or empty, or --overwrite).")
_STEP = flags.DEFINE_integer("step", None, "Export: the checkpoint step (default: the latest).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an earlier export (or imported workdir) at the target.")
_KIND = flags.DEFINE_enum("kind", "auto", ["auto", "neox", "custom"], "Export: GPT-NeoX when exact (auto), or forced.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Export: dtype of the saved weights.")
_IMPORT_FROM = flags.DEFINE_string("import_from", None, "Import: an HF directory to convert into a checkpoint.")
_CONFIG = cli.define_config_file("config", None, "Import: the training config (data, train) to continue with.")


def absl_main(argv):
  del argv
  from sparsetx.hf import export

  try:
    if not _WORKDIR.value:
      raise ConfigError("--workdir is required: the run to export, or the new run directory to import into.")
    if _IMPORT_FROM.value:
      if _OUT.value:
        raise ConfigError("--out and --import_from exclude each other: export writes --out, import writes --workdir.")
      config = export.import_hf(_IMPORT_FROM.value, _WORKDIR.value, overwrite=_OVERWRITE.value, config=_CONFIG.value)
      print(
        json.dumps(
          dict(
            imported=os.path.abspath(_IMPORT_FROM.value),
            workdir=os.path.abspath(_WORKDIR.value),
            step=0,
            model=config.model.to_dict(),
          ),
          indent=1,
        )
      )
    else:
      if not _OUT.value:
        raise ConfigError("--out is required to export: the directory to write the Hugging Face files to.")
      summary = export.export(
        _WORKDIR.value, _OUT.value, step=_STEP.value, overwrite=_OVERWRITE.value, kind=_KIND.value, dtype=_DTYPE.value
      )
      print(json.dumps(summary, indent=1))
  except ConfigError as error:
    cli.fail(error)


def main():
  """The `sparsetx-export` entry point."""
  cli.run(absl_main)


if __name__ == "__main__":
  main()
