"""Bad steps across processes (make test-long): a run killed with SIGKILL after it skipped resumes bitwise like the
run that never stopped (the spike window is checkpointed), and two processes roll back together."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import poisoned_stream
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO
from test_bad_steps import saved_states
from test_train import finish, losses, micro_config, wait_for_steps

from sparsetx.train.run import loop, recovery

TESTS = str(REPO / "tests")
SETTINGS = dict(steps=24, warmup_steps=5, log_every=1, eval_every=1000, eval_batches=1, spike_window=5)
BAD_IN_ROW = dict(skip=3, rollback=2)  # skip: the two spikes in a row go by; rollback: they roll back


def flags(mode: str) -> list[str]:
  """The command-line form of `config(mode)`."""
  return [
    "--config=configs/tiny.py:mlp",
    *MICRO_TRAIN_FLAGS,
    "--config.data.shuffle_buffer=64",
    *(f"--config.train.{k}={v}" for k, v in SETTINGS.items()),
    f"--config.train.bad_steps={mode}",
    f"--config.train.max_bad_in_row={BAD_IN_ROW[mode]}",
    "--config.checkpoint.every=4",
    "--config.checkpoint.keep=10",
  ]


def config(mode: str):
  config = micro_config("mlp", bad_steps=mode, **dict(SETTINGS, max_bad_in_row=BAD_IN_ROW[mode]))
  config.checkpoint.update(every=4, keep=10)
  return config


def poisoned_env(spikes, nans=()) -> dict:
  return dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
    SPARSETX_TEST_SPIKES=",".join(map(str, spikes)),
    SPARSETX_TEST_NANS=",".join(map(str, nans)),
  )


@pytest.mark.long
def test_a_run_killed_after_skipping_resumes_bitwise(tmp_path, monkeypatch):
  killed, whole = str(tmp_path / "killed"), str(tmp_path / "whole")
  log = open(f"{killed}.log", "w+")
  process = subprocess.Popen(
    [sys.executable, "-m", "poisoned_stream", f"--workdir={killed}", *flags("skip")],
    cwd=REPO,
    env=poisoned_env([9, 10], nans=[13]),
    stdout=log,
    stderr=subprocess.STDOUT,
    text=True,
  )
  process.log = log
  wait_for_steps(killed, 17, process)  # past the skips and the step-16 checkpoint
  process.send_signal(signal.SIGKILL)
  output = finish(process)
  assert "step 9 skipped" in output and "step 13 skipped: non-finite loss" in output, output[-3000:]
  poisoned_stream.install(monkeypatch, spikes=[9, 10], nans=[13])
  loop.train(config("skip"), killed)  # resumes from its newest checkpoint
  loop.train(config("skip"), whole)
  want, got = losses(whole), losses(killed)
  assert sorted(got) == list(range(1, 25))
  np.testing.assert_array_equal([got[s] for s in got], [want[s] for s in got])  # NaN at the NaN step
  with open(f"{whole}/metrics.jsonl") as f:
    skipped = [row["step"] for row in map(json.loads, f) if row.get("skipped")]
  assert {9, 10, 13} <= set(skipped)  # (a window of 5 is narrow: a clean step may exceed 6 of its deviations)
  for a, b in zip(*(jax.tree.leaves(saved_states(config("skip"), w, [24])[24]) for w in (killed, whole))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.long
def test_two_processes_roll_back_together(tmp_path, monkeypatch):
  two, one, logs = tmp_path / "two", tmp_path / "one", tmp_path / "logs"
  launcher = subprocess.run(
    [
      sys.executable,
      "-m",
      "sparsetx.tools.launch_local",
      "--num_processes=2",
      "--devices_per_process=2",
      "--module=poisoned_stream",
      f"--log_dir={logs}",
      "--",
      *flags("rollback"),
      f"--workdir={two}",
      "--config.mesh.dcn.data=-1",
    ],
    cwd=REPO,
    env=poisoned_env([12, 13]),
    capture_output=True,
    text=True,
    timeout=500,
  )
  assert launcher.returncode == 0, launcher.stdout[-3000:] + launcher.stderr[-3000:]
  for process in (0, 1):  # each process decided at the same step, from the same metrics
    log = (logs / f"process_{process}.log").read_text()
    assert "Rolled back to step 12 after step 13 (2 steps skipped in a row" in log, log[-3000:]
  windows = json.loads((two / recovery.RECORD).read_text())["windows"]
  assert [(w["steps"], w["restored_step"]) for w in windows] == [("13:13", 12)]  # step 12, skipped, kept step 11's
  poisoned_stream.install(monkeypatch, spikes=[12, 13])
  loop.train(config("rollback"), str(one))  # one process, 8 devices: the same decisions, the same batches
  assert json.loads((one / recovery.RECORD).read_text())["windows"][0]["steps"] == "13:13"
  want, got = losses(one), losses(two)
  assert sorted(got) == list(range(1, 25))
  # Another reduction order across processes (gloo): float32 rounding, far below a batch's difference.
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-4, atol=0)
