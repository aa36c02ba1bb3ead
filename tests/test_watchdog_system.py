"""Two processes (make test-long): one stopped with SIGSTOP mid-run can no longer speak; the other's watchdog ends
it within the timeout plus 30 s, with its stacks and one line; the launcher ends the stopped one and exits with the
watchdog's code; a relaunch of both resumes and ends bitwise like a run that never stopped."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO
from test_multihost_train import losses, wait_until

from sparsetx.train.run import watchdog

TIMEOUT_S = 15
FLAGS = [
  "--config=configs/tiny.py:mlp",
  *MICRO_TRAIN_FLAGS,
  "--config.train.steps=30",
  "--config.train.warmup_steps=5",
  "--config.train.log_every=1",
  "--config.train.eval_every=1000",
  "--config.checkpoint.every=5",
  f"--config.train.step_timeout_s={TIMEOUT_S}.0",
  "--config.mesh.dcn.data=-1",
  "--heartbeat_timeout=300",  # JAX's own check of a silent peer comes later than the watchdog here
]


def launch(workdir, logs, log_file, env=None) -> subprocess.Popen:
  command = [sys.executable, "-m", "sparsetx.tools.launch_local", "--num_processes=2", "--devices_per_process=2"]
  command += ["--grace_period=20", f"--log_dir={logs}", "--", *FLAGS, f"--workdir={workdir}"]
  return subprocess.Popen(command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=env)


@pytest.mark.long
def test_a_stopped_peer_ends_the_run_in_time_and_a_relaunch_resumes_bitwise(tmp_path):
  run, logs = tmp_path / "run", tmp_path / "logs"
  log = open(tmp_path / "launcher.log", "w+")
  reference = launch(tmp_path / "reference", tmp_path / "reference_logs", open(tmp_path / "reference.log", "w"))
  launcher = launch(run, logs, log)
  try:
    wait_until(lambda: (run / "checkpoints" / "10").is_dir(), [launcher], 300, "checkpoint 10")
    pids = [int(p) for p in re.findall(r"process \d pid (\d+)", (tmp_path / "launcher.log").read_text())]
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    wait_until(lambda: "process 0 exited" in (tmp_path / "launcher.log").read_text(), [], TIMEOUT_S + 30, "exit")
    took = time.monotonic() - stopped
    launcher.wait(timeout=60)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  summary = (tmp_path / "launcher.log").read_text()
  assert launcher.returncode == watchdog.WATCHDOG_EXIT_CODE, summary
  assert f"process 0 exited with code {watchdog.WATCHDOG_EXIT_CODE}" in summary, summary
  assert took <= TIMEOUT_S + 30, took
  log_0 = (logs / "process_0.log").read_text()
  errors = [line for line in log_0.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "error: process 0: nothing finished for" in errors[0], log_0[-3000:]
  assert "Thread" in log_0 and "most recent call first" in log_0, log_0[-3000:]  # faulthandler's stacks

  relaunch = launch(run, logs, open(tmp_path / "relaunch.log", "w"))
  assert relaunch.wait(timeout=400) == 0, (logs / "process_0.log").read_text()[-3000:]
  assert reference.wait(timeout=400) == 0, (tmp_path / "reference_logs" / "process_0.log").read_text()[-3000:]
  want, got = losses(tmp_path / "reference"), losses(run)
  assert sorted(got) == list(range(1, 31))
  np.testing.assert_array_equal([got[s] for s in got], [want[s] for s in got])


@pytest.mark.long
def test_a_peer_stuck_in_a_read_ends_the_run_in_time_with_a_line_from_each(tmp_path):
  """Process 1 stays alive, threads and heartbeats included, but blocks reading the batch of step 12 from a FIFO
  nobody writes (tests/stuck_read/sitecustomize.py): JAX's heartbeat sees nothing wrong, the watchdogs do. Process 0
  waits in step 12's collective, process 1 in its read; each writes its stacks and one line and exits with 6."""
  run, logs, fifo = tmp_path / "run", tmp_path / "logs", tmp_path / "never_written"
  os.mkfifo(fifo)
  env = dict(os.environ, STUCK_READ_FIFO=str(fifo), STUCK_AT_STEP="12")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "stuck_read"), env.get("PYTHONPATH", "")])
  log = open(tmp_path / "launcher.log", "w+")
  began = time.monotonic()
  launcher = launch(run, logs, log, env)
  try:
    wait_until(lambda: (run / "checkpoints" / "10").is_dir(), [launcher], 300, "checkpoint 10")
    reached = time.monotonic()
    launcher.wait(timeout=TIMEOUT_S + 90)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  summary = (tmp_path / "launcher.log").read_text()
  assert launcher.returncode == watchdog.WATCHDOG_EXIT_CODE, summary
  assert time.monotonic() - reached <= TIMEOUT_S + 30 + 20, (reached - began, summary)  # + the launcher's grace
  for i in (0, 1):
    text = (logs / f"process_{i}.log").read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"error: process {i}: nothing finished for" in errors[0], text[-3000:]
    if i == 1:
      assert "while running reading the batch of step 12;" in errors[0], errors
    assert "most recent call first" in text, text[-3000:]  # faulthandler's stacks
