"""Two processes x 2 devices (sparsetx/tools/launch_local.py) train the default config like one process x 4 devices
(to float32 rounding); their checkpoint resumes in one process, data position included, with no warning; a killed
process stops the other instead of hanging it.

One scenario, because starting trainers is what costs time: the two-process run (configs/tiny.py, no hand
tokenizing: process 0 writes <workdir>/tokenized while process 1 waits) trains past its step-8 checkpoint, then
process 1 is killed. Meanwhile a single-process driver trains the reference (the same global batches: the stream
does not depend on the process count), then resumes the two-process step-8 checkpoint and continues.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO

# configs/tiny.py (sgatlin, the default mixture) at a micro size, with no LR decay, so the schedule ignores
# train.steps.
MICRO = [
  "--config=configs/tiny.py",
  *MICRO_TRAIN_FLAGS,
  "--config.train.warmup_steps=5",
  "--config.train.decay_fraction=0",
  "--config.train.log_every=1",
  "--config.train.eval_every=1000",
  "--config.train.eval_batches=1",
  "--config.checkpoint.every=8",
]

# One process x 4 devices: the reference run, then a resume of the two-process run's step 8.
DRIVER = r"""
import json, os, shutil, sys, time
from absl import flags
from ml_collections import config_flags
out, multi, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config_flag = config_flags.DEFINE_config_file("config")
sys.argv = ["driver", *overrides]  # config_flags reads the overrides from sys.argv
flags.FLAGS(sys.argv)
config = config_flag.value
import jax
from sparsetx.train.run import loop

assert jax.process_count() == 1 and jax.device_count() == 4
loop.train(config, out + "/reference")
while not os.path.exists(out + "/checkpoint_8_done"):
  time.sleep(0.1)
shutil.copytree(f"{multi}/checkpoints/8", f"{out}/resumed/checkpoints/8")  # complete and never rewritten
loop.train(config, out + "/resumed")
"""


def losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {row["step"]: row["loss"] for row in map(json.loads, f) if "loss" in row}


def wait_until(condition, processes, timeout, what):
  deadline = time.time() + timeout
  while not condition():
    for process in processes:
      assert process.poll() is None, f"{process.args[:3]} ended (code {process.returncode}) before {what}"
    assert time.time() < deadline, f"no {what} within {timeout}s"
    time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.long
def test_two_processes_train_like_one_resume_in_one_and_stop_when_a_peer_dies(tmp_path):
  multi, logs = tmp_path / "multi", tmp_path / "logs"
  env = dict(os.environ)  # the session's JAX compilation cache (tests/conftest.py) is shared
  launcher_log = open(tmp_path / "launcher.log", "w+")
  launcher = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "sparsetx.tools.launch_local",
      "--num_processes=2",
      "--devices_per_process=2",
      "--grace_period=100",
      f"--log_dir={logs}",
      "--",
      *MICRO,
      f"--workdir={multi}",
      "--config.train.steps=1000",
      "--config.mesh.dcn.data=-1",
      "--heartbeat_timeout=10",
    ],
    cwd=REPO,
    env=env,
    stdout=launcher_log,
    stderr=subprocess.STDOUT,
  )
  driver_env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  driver_log = open(tmp_path / "driver.log", "w+")
  driver = subprocess.Popen(
    [sys.executable, "-c", DRIVER, str(tmp_path), str(multi), json.dumps(MICRO + ["--config.train.steps=10"])],
    cwd=REPO,
    env=driver_env,
    stdout=driver_log,
    stderr=subprocess.STDOUT,
  )
  try:
    # Checkpoint 8 is complete once orbax has renamed its directory into place.
    wait_until(lambda: (multi / "checkpoints" / "8").is_dir(), [launcher], 300, "two-process checkpoint 8")
    (tmp_path / "checkpoint_8_done").touch()
    pids = [int(p) for p in re.findall(r"process \d pid (\d+)", (tmp_path / "launcher.log").read_text())]
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.time()
    launcher.wait(timeout=120)
    stopped_after = time.time() - killed_at
    launcher_log.seek(0)
    summary = launcher_log.read()
    log_0 = (logs / "process_0.log").read_text()

    # Process 0 stopped on its own (not killed by the launcher), non-zero, saying why, well within 2 minutes.
    assert launcher.returncode != 0, summary
    assert "process 1 was killed by SIGKILL" in summary, summary
    assert re.search(r"process 0 (exited with code [1-9]|was killed by SIGABRT)", summary), summary
    assert "another task died" in log_0 and "stopped sending heartbeats" in log_0, log_0[-3000:]
    assert stopped_after < 60, f"{stopped_after:.0f}s"

    driver.wait(timeout=240)
    driver_log.seek(0)
    assert driver.returncode == 0, driver_log.read()[-5000:]
  finally:
    if launcher.poll() is None:  # its processes are still alive (it waits for them): stop them first
      for pid in re.findall(r"process \d pid (\d+)", (tmp_path / "launcher.log").read_text()):
        try:
          os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
          pass
    for process in (launcher, driver):
      if process.poll() is None:
        process.kill()

  two, one = losses(multi), losses(tmp_path / "reference")
  # Same batches, same float32 math; only the cross-process all-reduce (gloo) sums the 4 devices' partial losses
  # and gradients in another order than one process does: a few ulps, which sgatlin's top-k can turn into a
  # different pick of a near-tie; 1e-4 relative (the bound) is far below what a wrong batch makes.
  np.testing.assert_allclose([two[s] for s in range(1, 9)], [one[s] for s in range(1, 9)], rtol=1e-4, atol=0)
  assert one[8] < one[1] - 0.05  # it trained: equal losses are not equal constants
  # One process restores the two-process checkpoint (model, optimizer, the stream's step) and continues as the
  # single-process run that never stopped, without any warning about the stream.
  resumed = losses(tmp_path / "resumed")
  assert sorted(resumed) == [9, 10]
  np.testing.assert_allclose([resumed[9], resumed[10]], [one[9], one[10]], rtol=1e-4, atol=0)
  driver_log.seek(0)
  output = driver_log.read()
  assert "data state" not in output and "starts over" not in output, output[-3000:]
