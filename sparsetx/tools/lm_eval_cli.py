"""lm-evaluation-harness with the `sparsetx` model registered: lm-eval's own CLI, same arguments.

  python -m sparsetx.tools.lm_eval_cli --model sparsetx --model_args workdir=DIR[,step=N] --batch_size 8 \
      --tasks sparsetx_facts_cloze,sparsetx_facts_choice --include_path sparsetx/evaluate/lm_eval_tasks

`python -m lm_eval --model sparsetx` cannot work: lm-eval 0.4.13 finds models only in its own
registry, filled by its own modules (no plugin entry points), so the adapter must be imported in
the same process first; that is all this program adds. Its flags are lm-eval's (argparse, parsed by
lm-eval's `cli_evaluate`), not absl's: it is lm-eval's command line. Run it from the repository root
(the local tasks name their data file from there). Offline: HF_DATASETS_OFFLINE=1 is set unless given.
The module is not named lm_eval.py so that it can never shadow the lm_eval package.
"""

import os

from sparsetx import torch_compat


def main():
  """The `sparsetx-lm-eval` entry point."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm-eval imports `datasets`, which reads it once
  torch_compat.keep_triton_out()  # before lm-eval loads torch: the checkpoint's data path loads TensorFlow
  from lm_eval.__main__ import cli_evaluate

  import sparsetx.evaluate.lm_eval_adapter  # noqa: F401  (registers --model sparsetx)

  cli_evaluate()


if __name__ == "__main__":
  main()
