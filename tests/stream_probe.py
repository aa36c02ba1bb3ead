"""`python -m tests.stream_probe FLAGS...`: `python -m sparsetx.train` whose processes each record what they read.

Every batch a process takes from the tokenized stream (global_stream.GlobalStream.next_local) is appended to
$STREAM_PROBE_DIR/rows_<pid>.jsonl as {"step": stream step, "first": first row, "digests": [per-row sha256]},
so a test can rebuild each global batch from the rows of all processes, whatever their number.
"""

import hashlib
import json
import os

import sparsetx.tools  # noqa: F401  (first: the programs' quiet console filters TensorFlow's start-up notices)
from sparsetx.data import global_stream
from sparsetx.data.batches import FEATURES
from sparsetx.tools import train as train_main

_next_local = global_stream.GlobalStream.next_local


def _recording_next_local(self):
  step = self.step
  local = _next_local(self)
  digests = [
    hashlib.sha256(b"".join(local[k][n].tobytes() for k in FEATURES)).hexdigest()
    for n in range(local["targets"].shape[0])
  ]
  with open(os.path.join(os.environ["STREAM_PROBE_DIR"], f"rows_{os.getpid()}.jsonl"), "a") as f:
    f.write(json.dumps(dict(step=step, first=self.first_row, digests=digests)) + "\n")
  return local


global_stream.GlobalStream.next_local = _recording_next_local

if __name__ == "__main__":
  train_main.main()
