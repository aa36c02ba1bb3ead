"""Two processes x 2 devices (sparsetx/tools/launch_local.py) train like one process x 4 devices (to float32
rounding); their checkpoint resumes in one process; a killed process stops the other instead of
hanging it; a checkpoint of another process count resumes the model and restarts the data stream.

One scenario, because starting trainers is what costs time: the two-process run trains past its
step-10 checkpoint, then process 1 is killed. Meanwhile a single-process driver trains the reference
on the same global batches (both processes' data shards, read in one process), then resumes the
two-process step-10 checkpoint and continues.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import seqio
from conftest import MICRO_TRAIN_FLAGS, REPO, RecordingCheckpointer

# micro_config("mlp") of tests/test_train.py as flags, with: no LR decay, so the schedule ignores
# train.steps; the facts task alone, whose pipeline and validation split build in a fifth of the
# default mixture's time; the dense MLP, whose step compiles in half of sgatlin's time (this tests
# the multi-host machinery; the layers' sharded equivalence is tests/test_train.py's).
MICRO = [
  "--config=configs/tiny.py:mlp",
  "--config.data.mixture=(('facts', 1.0),)",
  *MICRO_TRAIN_FLAGS,
  "--config.data.shuffle_buffer=64",
  "--config.train.warmup_steps=5",
  "--config.train.decay_fraction=0",
  "--config.train.log_every=1",
  "--config.train.eval_every=1000",
  "--config.train.eval_batches=1",
  "--config.checkpoint.every=10",
]

# One process x 4 devices. The loop's data iterator is replaced by one that reads data shards 0 and 1
# of 2 (what processes 0 and 1 read) and concatenates them: the two-process run's global batch.
DRIVER = r"""
import json, os, shutil, sys, time
from absl import flags
from ml_collections import config_flags
out, multi, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config_flag = config_flags.DEFINE_config_file("config")
sys.argv = ["driver", *overrides]  # config_flags reads the overrides from sys.argv
flags.FLAGS(sys.argv)
config = config_flag.value
import jax, numpy as np
from sparsetx.data import pipeline
from sparsetx.train import loop

class HalfRows:
  # A batch sharding as process `index` of 2 sees it: its devices hold one contiguous half of the rows.
  def __init__(self, index, rows):
    self.rows = slice(index * rows // 2, (index + 1) * rows // 2)
  def addressable_devices_indices_map(self, shape):
    return {"device": (self.rows,)}

class TwoProcessStreams:
  def __init__(self, config, sharding):
    self.parts = [pipeline.TrainIterator(config, HalfRows(i, config.data.global_batch_size)) for i in range(2)]
    self.shard_info, self.sharding = self.parts[0].shard_info, sharding
  def __iter__(self):
    return self
  def __next__(self):
    local = [part.next_local() for part in self.parts]
    return {k: jax.device_put(np.concatenate([l[k] for l in local]), self.sharding) for k in local[0]}
  def save(self, path):
    for part in self.parts:
      part.save(path)
  def restore(self, path):
    for part in self.parts:
      part.restore(path)
  def close(self):
    for part in self.parts:
      part.close()

assert jax.process_count() == 1 and jax.device_count() == 4
pipeline.make_train_iterator = TwoProcessStreams
loop.train(config, out + "/reference")
while not os.path.exists(out + "/checkpoint_10_done"):
  time.sleep(0.1)
for item in ("checkpoints/10", "data_state/10"):  # complete and never rewritten, while that run goes on
  shutil.copytree(f"{multi}/{item}", f"{out}/resumed/{item}")
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
    [sys.executable, "-c", DRIVER, str(tmp_path), str(multi), json.dumps(MICRO + ["--config.train.steps=12"])],
    cwd=REPO,
    env=driver_env,
    stdout=driver_log,
    stderr=subprocess.STDOUT,
  )
  try:
    # Checkpoint 10 is complete once orbax has renamed its directory into place.
    wait_until(lambda: (multi / "checkpoints" / "10").is_dir(), [launcher], 240, "two-process checkpoint 10")
    (tmp_path / "checkpoint_10_done").touch()
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
  # Same batches, same float32 math; only the cross-process all-reduce (gloo) sums the 4 devices'
  # partial losses and gradients in another order than one process does: measured differences are
  # 0-2 ulps (<= 1e-6 absolute at loss ~6); rtol 1e-6 allows ~10 ulps and nothing a real bug makes.
  np.testing.assert_allclose([two[s] for s in range(1, 11)], [one[s] for s in range(1, 11)], rtol=1e-6, atol=0)
  assert one[10] < one[1] - 0.05  # it trained: equal losses are not equal constants
  # One process restores the two-process checkpoint (model, optimizer, both data positions) and
  # continues as the single-process run that never stopped (its parameters carry the same ulps).
  resumed = losses(tmp_path / "resumed")
  assert sorted(resumed) == [11, 12]
  np.testing.assert_allclose([resumed[11], resumed[12]], [one[11], one[12]], rtol=1e-6, atol=0)


def test_a_checkpoint_of_another_process_count_resumes_the_model_and_restarts_the_data(tmp_path, caplog):
  from sparsetx.train import loop

  for index in range(2):  # what two processes save (sparsetx/data/pipeline.py, TrainIterator.save)
    shard = tmp_path / "10" / f"shard_{index:05d}_of_00002"
    shard.mkdir(parents=True)
    (shard / "data_state.json").write_text(json.dumps(dict(format=1, num_shards=2, shard_index=index, steps=10)))
  one_process, same_sharding = RecordingCheckpointer(tmp_path), RecordingCheckpointer(tmp_path)
  loop.restore(one_process, 10, None, types.SimpleNamespace(shard_info=seqio.ShardInfo(0, 1)))
  loop.restore(same_sharding, 10, None, types.SimpleNamespace(shard_info=seqio.ShardInfo(1, 2)))
  assert one_process.calls == [("model", 10)] and same_sharding.calls == [("model and data", 10)]
  assert "saved by 2 data shard(s) (processes); this run reads 1, so the data stream starts over" in caplog.text
