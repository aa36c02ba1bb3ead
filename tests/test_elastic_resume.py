"""Elastic resume on the tokenized stream (issue 26): a run of 2 processes x 2 devices (launch_local: jax.distributed,
gloo) checkpoints step 2 and goes on to step 4; its step-2 checkpoint resumes on 2 processes again, on 1 process
of 4 devices and on 4 processes of 2 devices. Every resumed step reads the global batch the uninterrupted run
read (each process records digests of its rows: tests/stream_probe.py), and where the mesh is the same (2 x 2) the
loss is the same bit for bit.

Starting trainer processes is what costs time: one tiny MLP, 4 steps, one evaluation batch, and the three
resumes run at once.
"""

import collections
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO, write_tokenized_corpus

from sparsetx.data import corpus

FLAGS = [
  "--config=configs/tiny.py:mlp",
  *MICRO_TRAIN_FLAGS,
  "--config.train.steps=4",
  "--config.train.warmup_steps=1",
  "--config.train.log_every=1",
  "--config.train.eval_every=1000",
  "--config.train.eval_batches=1",
  "--config.checkpoint.every=2",
  "--config.mesh.dcn.data=-1",
]


def launch(tmp_path, name, processes, devices, corpus_dir):
  """Starts launch_local running tests/stream_probe.py (the trainer, recording its rows) in <tmp_path>/<name>."""
  probe = tmp_path / f"{name}_rows"
  probe.mkdir()
  env = dict(os.environ, STREAM_PROBE_DIR=str(probe))
  log = open(tmp_path / f"{name}.log", "w")
  command = [
    sys.executable,
    "-m",
    "sparsetx.tools.launch_local",
    f"--num_processes={processes}",
    f"--devices_per_process={devices}",
    "--module=tests.stream_probe",
    "--",
    *FLAGS,
    f"--config.data.tokenized_dir={corpus_dir}",
    f"--workdir={tmp_path / name}",
  ]
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(tmp_path, name, process, timeout=600):
  process.wait(timeout=timeout)
  assert process.returncode == 0, (tmp_path / f"{name}.log").read_text()[-5000:]


def batches(tmp_path, name) -> dict[int, tuple]:
  """{train step: the global batch's row digests}, rebuilt from every process's rows."""
  rows = collections.defaultdict(dict)
  for path in (tmp_path / f"{name}_rows").glob("rows_*.jsonl"):
    for record in map(json.loads, path.read_text().splitlines()):
      for n, digest in enumerate(record["digests"]):
        rows[record["step"] + 1][record["first"] + n] = digest
  assert all(sorted(r) == list(range(8)) for r in rows.values()), {s: sorted(r) for s, r in rows.items()}
  return {step: tuple(r[n] for n in range(8)) for step, r in rows.items()}


def losses(tmp_path, name) -> dict[int, float]:
  with open(tmp_path / name / "metrics.jsonl") as f:
    return {row["step"]: row["loss"] for row in map(json.loads, f) if "loss" in row}


@pytest.mark.slow
@pytest.mark.long
def test_a_checkpoint_resumes_the_same_batches_on_1_2_and_4_processes(tmp_path):
  documents = {
    "stories": {"train": corpus.stories("train")[:300], "validation": corpus.stories("validation")[:20]},
    "facts": {"train": corpus.fact_documents("train")[:600], "validation": corpus.fact_documents("validation")},
  }
  corpus_dir = write_tokenized_corpus(tmp_path / "corpus", documents)
  finish(tmp_path, "whole", launch(tmp_path, "whole", 2, 2, corpus_dir))
  resumes = {"two": (2, 2), "one": (1, 4), "four": (4, 2)}
  for name in resumes:
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "2", tmp_path / name / "checkpoints" / "2")
  running = {name: launch(tmp_path, name, p, d, corpus_dir) for name, (p, d) in resumes.items()}
  for name, process in running.items():
    finish(tmp_path, name, process)

  whole = batches(tmp_path, "whole")
  assert sorted(whole) == [1, 2, 3, 4] and len(set(whole.values())) == 4  # four different batches
  for name in resumes:
    assert batches(tmp_path, name) == {3: whole[3], 4: whole[4]}, name
  reference = losses(tmp_path, "whole")
  assert sorted(losses(tmp_path, "two")) == [3, 4]
  assert [losses(tmp_path, "two")[s] for s in (3, 4)] == [reference[3], reference[4]]  # same mesh: bit for bit
  # Another mesh sums the same rows' losses and gradients in another order: float32 rounding, a few ulps.
  for name in ("one", "four"):
    np.testing.assert_allclose([losses(tmp_path, name)[s] for s in (3, 4)], [reference[3], reference[4]], rtol=1e-5)
