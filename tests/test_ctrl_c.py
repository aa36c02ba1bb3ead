"""Ctrl-C in training: the first SIGINT saves at the step reached and stops cleanly, as SIGTERM does (and a rerun
resumes bitwise); a second aborts at once in one line, with no traceback, whatever the main thread is doing."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO
from test_train import finish, losses, micro_config, run_cli, wait_for_steps

from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import agreement as agreement_lib
from sparsetx.train.run import ctrl_c, loop


@contextlib.contextmanager
def sigint_inherited():
  """A child inherits an ignored SIGINT (as a background job's): started from here, it must get the default."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


@pytest.mark.long  # three runs of the micro model, two of them in processes of their own: about a minute
def test_first_ctrl_c_saves_at_the_step_reached_and_a_rerun_resumes_bitwise(tmp_path):
  interrupted, uninterrupted = str(tmp_path / "i"), str(tmp_path / "u")
  with sigint_inherited():
    process = run_cli(interrupted, "--config.checkpoint.every=1000")
  wait_for_steps(interrupted, 3, process)
  process.send_signal(signal.SIGINT)
  output = finish(process)
  assert process.returncode == 0, output[-3000:]
  assert output.count("Ctrl-C received: saving a checkpoint at the current step") == 1, output[-3000:]
  assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
  stopped_at = max(losses(interrupted))
  assert 3 <= stopped_at < 20
  assert f"Stopped at step {stopped_at} of 20" in output
  manager = checkpointing.Checkpointer(interrupted, micro_config().checkpoint)
  assert manager.latest_step() == stopped_at  # saved where it stopped, though `every` is 1000
  manager.close()

  loop.train(micro_config(), interrupted)  # the rerun resumes
  loop.train(micro_config(), uninterrupted)
  assert losses(interrupted) == losses(uninterrupted)  # every step's loss, bitwise


@pytest.mark.long  # half a minute, most of it JAX's start and the compile
def test_a_second_ctrl_c_aborts_a_run_at_once_in_one_line(tmp_path):
  workdir = str(tmp_path / "w")
  with sigint_inherited():
    process = run_cli(workdir, "--config.train.steps=100000", "--config.checkpoint.every=100000")
  wait_for_steps(workdir, 3, process)
  process.send_signal(signal.SIGINT)
  time.sleep(0.05)  # the stop, its save and the teardown take far longer
  process.send_signal(signal.SIGINT)
  output = finish(process, timeout=30)
  assert process.returncode == ctrl_c.ABORT_EXIT_CODE, output[-3000:]
  assert output.count(ctrl_c.ABORT_LINE) == 1, output[-3000:]
  assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]


CHILD = textwrap.dedent(
  """
  import signal, sys, time
  from sparsetx.train.run import ctrl_c
  if sys.argv[1] == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
  handler = ctrl_c.CtrlC(lambda: print("first", flush=True))
  print("ready", flush=True)
  time.sleep(30)  # the main thread never runs a line of its own: only the watcher can act
  handler.restore()
  print("slept", flush=True)
  """
)


def start_child(mode: str) -> subprocess.Popen:
  with sigint_inherited():
    process = subprocess.Popen(
      [sys.executable, "-c", CHILD, mode], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
  assert process.stdout.readline() == "ready\n"
  return process


def test_the_second_ctrl_c_acts_while_the_main_thread_is_busy():
  process = start_child("default")
  process.send_signal(signal.SIGINT)
  assert process.stdout.readline() == "first\n"  # the first only asks for a stop: the process goes on
  assert process.poll() is None
  began = time.monotonic()
  process.send_signal(signal.SIGINT)
  assert process.wait(timeout=10) == ctrl_c.ABORT_EXIT_CODE
  assert time.monotonic() - began < 10
  assert process.stderr.read() == ctrl_c.ABORT_LINE  # the one line, nothing else
  process.stdout.close(), process.stderr.close()


def test_a_process_started_with_ctrl_c_ignored_keeps_ignoring_it():
  process = start_child("ignored")
  for _ in range(2):
    process.send_signal(signal.SIGINT)
  time.sleep(0.5)
  assert process.poll() is None  # no abort
  process.send_signal(signal.SIGTERM)
  process.wait(timeout=10)
  assert process.stdout.read() == ""  # nor a stop request
  process.stdout.close(), process.stderr.close()


def test_the_trainers_agreement_takes_a_first_ctrl_c_as_a_stop():
  before = signal.getsignal(signal.SIGINT)
  agreement = agreement_lib.Agreement(every_minutes=0.0)
  try:
    assert agreement.at(1) == (False, False)
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt here: the handler only asks for a stop
    deadline = time.monotonic() + 10
    while not agreement.raised and time.monotonic() < deadline:
      time.sleep(0.01)
    assert agreement.at(2) == (True, False)  # stop at the next step, as after SIGTERM (the loop saves there)
  finally:
    agreement.restore()
  assert signal.getsignal(signal.SIGINT) is before and signal.set_wakeup_fd(-1) == -1  # both put back


def test_a_run_that_fails_before_its_first_step_puts_its_handlers_back(tmp_path, monkeypatch):
  """The trainer runs in processes that go on (a sweep, a notebook, a test worker): a run ending in an error before
  its first step must not leave a later Ctrl-C asking a gone run to save."""
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

  def unreadable(run):
    raise OSError("the shard is damaged")

  monkeypatch.setattr(loop, "_first_batch", unreadable)
  with pytest.raises(OSError, match="the shard is damaged"):
    loop.train(micro_config(steps=2), str(tmp_path / "run"))
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  assert signal.set_wakeup_fd(-1) == -1
