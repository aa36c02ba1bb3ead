"""lm-evaluation-harness with the `sparsetx` model registered: lm-eval's own CLI, same arguments.

  python tools/lm_eval.py --model sparsetx --model_args workdir=DIR[,step=N] --batch_size 8 \
      --tasks sparsetx_facts_cloze,sparsetx_facts_choice --include_path sparsetx/evaluate/lm_eval_tasks

`python -m lm_eval --model sparsetx` cannot work: lm-eval 0.4.13 finds models only in its own
registry, filled by its own modules (no plugin entry points), so the adapter must be imported in
the same process first; that is all this program adds. Run it from the repository root (the local
tasks name their data file from there). Offline: HF_DATASETS_OFFLINE=1 is set unless given.
"""

import os
import sys

# This file is named lm_eval.py: its own directory must not shadow the lm_eval package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from lm_eval.__main__ import cli_evaluate  # noqa: E402

import sparsetx.evaluate.lm_eval_adapter  # noqa: E402,F401  (registers --model sparsetx)

if __name__ == "__main__":
  cli_evaluate()
