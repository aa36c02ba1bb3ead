"""The hang watchdog (sparsetx/train/run/watchdog.py): a process stuck in a read (its threads alive) ends with every
thread's stack, one `error:` line naming what hung and the last finished step, and exit code 6; the derived timeout
follows the measured steps. (Two processes, one of them stopped: tests/test_watchdog_system.py.)"""

import os
import subprocess
import sys
import time

from conftest import REPO

from sparsetx.tools import launch_local
from sparsetx.train.run import watchdog

STUCK = r"""
import os, sys
from sparsetx.tools import launch_local
from sparsetx.train.run import watchdog
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


PEERS = r"""
import sys, time, jax
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]))
from sparsetx.tools import launch_local
from sparsetx.train.run import watchdog
i = jax.process_index()
dog = watchdog.Watchdog(2.0, process=i, peers=watchdog.Peers.of_this_run(i))
dog.progress(7, 0.01)
dog.doing("reading the batch of step 8" if i == 1 else "step 8")
def read_the_batch():
  with open(sys.argv[3], "rb") as fifo:  # nobody writes: the read never returns
    fifo.read()
if i == 1:
  read_the_batch()
while True:  # process 0 stays healthy: only process 1's post can end it
  time.sleep(0.2)
  dog.progress()
"""


def test_a_fired_process_tells_its_peers_so_each_writes_its_own_stacks_and_line(tmp_path):
  """Process 1 hangs in a read, process 0 keeps finishing things: process 0 still ends, with its own stacks and a
  line naming process 1, and process 1 with the stuck frame, neither ended by the other's exit first."""
  fifo, port = tmp_path / "shard.fifo", launch_local.free_port()
  os.mkfifo(fifo)
  env = launch_local.child_env(1)
  processes = [
    subprocess.Popen(
      [sys.executable, "-c", PEERS, str(port), str(i), str(fifo)],
      cwd=REPO,
      env=env,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in (0, 1)
  ]
  outputs = [p.communicate(timeout=120)[1] for p in processes]
  for i, (p, output) in enumerate(zip(processes, outputs)):
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert p.returncode == watchdog.WATCHDOG_EXIT_CODE and len(errors) == 1, output[-3000:]
    assert errors[0].startswith(f"error: process {i}: nothing finished for ") and "most recent call first" in output
  assert "(process 1's watchdog fired first)" in outputs[0] and "in read_the_batch" in outputs[1]
  assert "fired first" not in outputs[1]


class _Unanswered(watchdog.Peers):
  """A peer that never posts (stopped), or a coordinator that never answers (`hang`)."""

  def __init__(self, hang: bool):
    super().__init__(client=None, count=2, process=0)
    self._hang, self._lines = hang, {}

  def posted(self):
    while self._hang:
      time.sleep(1)
    return dict(self._lines)

  def post(self, line):
    self._lines[self.process] = line


UNANSWERED = r"""
import sys, time
sys.path.insert(0, "tests")
from test_watchdog import _Unanswered
from sparsetx.train.run import watchdog
dog = watchdog.Watchdog(1.0, peers=_Unanswered(hang=sys.argv[1] == "hang"))
dog.progress(7, 0.01)
dog.doing("step 8")
time.sleep(600)
"""


def test_a_peer_or_coordinator_that_never_answers_holds_the_exit_only_for_the_bound():
  for how in ("silent", "hang"):
    started = time.monotonic()
    result = subprocess.run(
      [sys.executable, "-c", UNANSWERED, how], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - started
    assert result.returncode == watchdog.WATCHDOG_EXIT_CODE, result.stderr
    period = 1.0 / 4
    # the limit, one watch period to see it, the bounded wait, and Python's start (generous: a loaded machine)
    assert took < 1.0 + period + watchdog.PEER_WAIT_PERIODS * period + 10, (how, took)
