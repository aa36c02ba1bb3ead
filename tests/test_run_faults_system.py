"""A bad day for a long run, as whole trainer processes (make test-long): slow storage and a slow first evaluation
under a 2 s step limit end in exit 0; a watchdog that ends a hung rollback's restore leaves the window recorded,
so the restart steps over the bad batches; a run killed with SIGKILL leaves a goodput record from which the restart
counts the time since as lost and the steps it repeats as redone."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO
from test_train import finish, losses, micro_config, wait_for_steps

from sparsetx.train.run import goodput, loop, recovery, watchdog

TESTS = str(REPO / "tests")
FLAGS = [
  "--config=configs/tiny.py:mlp",
  *MICRO_TRAIN_FLAGS,
  "--config.data.shuffle_buffer=64",
  "--config.train.steps=16",
  "--config.train.warmup_steps=5",
  "--config.train.log_every=1",
  "--config.train.eval_every=8",
  "--config.train.eval_batches=1",
  "--config.train.spike_window=5",
  "--config.train.max_bad_in_row=2",
  "--config.train.bad_steps=rollback",
  "--config.train.step_timeout_s=2",
  "--config.checkpoint.every=4",
  "--config.checkpoint.keep=10",
]


def slow_trainer(workdir, *flags, **slow) -> subprocess.Popen:
  """tests/slow_storage.py's trainer on `workdir`, batches 12 and 13 spiking, `slow` {SAVE|WAIT|RESTORE|EVAL: s}."""
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
    SPARSETX_TEST_SPIKES="12,13",
    **{f"SPARSETX_TEST_SLOW_{name}": str(seconds) for name, seconds in slow.items()},
  )
  log = open(f"{workdir}.log", "w+")
  process = subprocess.Popen(
    [sys.executable, "-m", "slow_storage", f"--workdir={workdir}", *FLAGS, *flags],
    cwd=REPO,
    env=env,
    stdout=log,
    stderr=subprocess.STDOUT,
    text=True,
  )
  process.log = log
  return process


def errors(output: str) -> list[str]:
  return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.mark.long
def test_slow_saves_restores_and_a_slow_first_evaluation_end_a_run_well(tmp_path):
  # Each 6 s against a 2 s step limit: the first save, the rollback's wait and restore, the first evaluation's
  # batch, the last save's wait.
  workdir = tmp_path / "run"
  process = slow_trainer(workdir, SAVE=6, WAIT=6, RESTORE=6, EVAL=6)
  output = finish(process, timeout=400)
  assert process.returncode == 0 and not errors(output), output[-3000:]
  assert "Rolled back to step 12 after step 13" in output and "eval loss" in output, output[-3000:]
  assert sorted(losses(workdir))[-1] == 16


@pytest.mark.long
def test_a_restore_that_hangs_in_a_rollback_leaves_its_window_for_the_restart(tmp_path):
  workdir = tmp_path / "run"
  process = slow_trainer(workdir, "--config.train.restore_timeout_s=3", RESTORE=1000)
  output = finish(process, timeout=400)
  assert process.returncode == watchdog.WATCHDOG_EXIT_CODE, output[-3000:]
  (line,) = errors(output)
  assert (
    "(config.train.restore_timeout_s=3.0: 3 s) while running the restore of step 12 for the rollback after " in line
  )
  windows = json.loads((workdir / recovery.RECORD).read_text())["windows"]
  assert [(w["steps"], w["restored_step"]) for w in windows] == [("13:13", 12)]
  restart = slow_trainer(workdir)  # batch 13 spikes again, but the restart steps over it
  output = finish(restart, timeout=400)
  assert restart.returncode == 0 and "skipped" not in output.split("Resumed from")[1], output[-3000:]
  assert json.loads((workdir / recovery.RECORD).read_text())["windows"] == windows


@pytest.mark.long
def test_a_run_killed_mid_way_is_counted_lost_and_its_repeated_steps_redone(tmp_path):
  workdir = str(tmp_path / "run")
  config = micro_config("mlp", steps=30)
  config.checkpoint.update(every=10, keep=5, every_minutes=0.0)
  flags = [f"--config.train.{k}={v}" for k, v in dict(steps=30, eval_every=1000, eval_batches=1).items()]
  log = open(f"{workdir}.log", "w+")
  process = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "sparsetx.train",
      "--config=configs/tiny.py:mlp",
      f"--workdir={workdir}",
      *MICRO_TRAIN_FLAGS,
      "--config.data.shuffle_buffer=64",
      "--config.train.warmup_steps=5",
      "--config.train.log_every=1",
      "--config.checkpoint.every=10",
      "--config.checkpoint.every_minutes=0",
      *flags,
    ],
    cwd=REPO,
    stdout=log,
    stderr=subprocess.STDOUT,
    text=True,
  )
  process.log = log
  wait_for_steps(workdir, 15, process)  # past the step-10 checkpoint
  process.send_signal(signal.SIGKILL)
  finish(process)
  record = json.loads((tmp_path / "run" / goodput.RECORD).read_text())
  assert record["status"] == "running" and record["reached"] >= 14 and record["seconds"]["lost"] == 0.0
  time.sleep(1.0)
  restarted = time.time()
  loop.train(config, workdir)  # resumes from step 10: steps 11 to `reached` again
  after = json.loads((tmp_path / "run" / goodput.RECORD).read_text())
  assert after["status"] == "finished" and after["runs"] == 2 and after["reached"] == 30
  assert after["seconds"]["lost"] >= restarted - record["written_at"], (after, record)
  assert after["seconds"]["redone_steps"] > 0 and after["productive_steps"] == 30
  assert abs(sum(after["seconds"].values()) - after["wall"]) < 1e-6 * after["wall"]
  # Only the resumed start measured what a restart costs (the first had no restore, and tokenized the corpus).
  assert len(after["costs"]["restart_seconds"]) == 1 and len(after["costs"]["restore_seconds"]) == 1
