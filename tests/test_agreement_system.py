"""Two processes (make test-long) agree by time, not by `log_every`: a save by time
(config.checkpoint.every_minutes) lands on the same step on both, and SIGTERM to one of them saves and stops both
within seconds though log_every and checkpoint.every are far away."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO
from test_multihost_train import wait_until


@pytest.mark.long
def test_a_save_by_time_and_sigterm_to_one_process_are_agreed_within_seconds(tmp_path):
  run, logs = tmp_path / "run", tmp_path / "logs"
  log = open(tmp_path / "launcher.log", "w+")
  command = [sys.executable, "-m", "sparsetx.tools.launch_local", "--num_processes=2", "--devices_per_process=2"]
  command += [f"--log_dir={logs}", "--", "--config=configs/tiny.py:mlp", *MICRO_TRAIN_FLAGS, f"--workdir={run}"]
  command += [
    "--config.train.steps=100000",
    "--config.train.log_every=100000",
    "--config.train.eval_every=100000",
    "--config.checkpoint.every=100000",
    "--config.checkpoint.every_minutes=0.1",  # 6 s
    "--config.mesh.dcn.data=-1",
  ]
  launcher = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  try:
    checkpoints = run / "checkpoints"
    saved = lambda: checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())  # noqa: E731
    wait_until(saved, [launcher], 300, "a save by time")
    pids = [int(p) for p in re.findall(r"process \d pid (\d+)", (tmp_path / "launcher.log").read_text())]
    os.kill(pids[1], signal.SIGTERM)  # one process only, as a preemption notice may reach one host first
    signalled = time.monotonic()
    assert launcher.wait(timeout=60) == 0, (logs / "process_0.log").read_text()[-3000:]
    took = time.monotonic() - signalled
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert took < 20, took  # the agreement comes about every 5 s, then the save and the exit
  steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  assert len(steps) >= 2 and all(s % 100000 for s in steps), steps  # by time, then at the agreed stop
  with open(run / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert steps[-1] == max(row["step"] for row in rows)  # saved where both stopped
  assert "SIGTERM received" in (logs / "process_1.log").read_text()
