"""The hang watchdog (sparsetx/train/watchdog.py): a process stuck in a read (its threads alive) ends with every
thread's stack, one `error:` line naming what hung and the last finished step, and exit code 6; the derived timeout
follows the measured steps. (Two processes, one of them stopped: tests/test_watchdog_system.py.)"""

import os
import subprocess
import sys
import time

from conftest import REPO

from sparsetx.train import watchdog

STUCK = r"""
import os, sys
from sparsetx.train import watchdog
dog = watchdog.Watchdog(float(sys.argv[2]))
dog.progress(7, 0.01)
dog.doing("reading the batch of step 8")
def read_the_batch():
  with open(sys.argv[1], "rb") as fifo:  # nobody writes: the read never returns
    fifo.read()
read_the_batch()
"""


def test_a_stuck_read_ends_in_its_stacks_one_line_and_exit_code_6(tmp_path):
  fifo = tmp_path / "shard.fifo"
  os.mkfifo(fifo)
  started = time.monotonic()
  result = subprocess.run(
    [sys.executable, "-c", STUCK, str(fifo), "1.5"], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  took = time.monotonic() - started
  assert result.returncode == watchdog.WATCHDOG_EXIT_CODE, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr
  assert (
    errors[0].startswith("error: process 0: nothing finished for ")
    and (
      "(config.train.step_timeout_s=1.5: 2 s) while running reading the batch of step 8; the last finished step is 7"
    )
    in errors[0]
  ), errors[0]
  assert 'in read_the_batch' in result.stderr and "sparsetx-watchdog" not in errors[0]  # the stuck frame
  assert took < 1.5 + 5 + 10, took  # the timeout, one watch period, and Python's start


def test_the_derived_timeout_follows_the_slowest_measured_step():
  dog = watchdog.Watchdog(None)
  try:
    assert dog.limit() == watchdog.FLOOR_S
    dog.progress(1, None)  # the first step compiled: not measured
    for step, seconds in ((2, 3.0), (3, 40.0), (4, 5.0)):
      dog.progress(step, seconds)
    assert dog.limit() == watchdog.STEP_FACTOR * 40.0
  finally:
    dog.close()
  assert watchdog.Watchdog(0)._thread is None  # 0: off
