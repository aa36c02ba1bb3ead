"""SIGTERM, a first Ctrl-C and config.checkpoint.every_minutes, agreed by every process at the same step: the run's
stop and its saves by time.

More: docs/modules.md.
"""

import signal
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from sparsetx.train.run import ctrl_c

AGREE_EVERY_S = 5.0  # processes agree on SIGTERM and on a save by time at least this often


class Agreement:
  """SIGTERM (preemption) or a first Ctrl-C, and config.checkpoint.every_minutes, agreed by every process at the same step: a signal
  reaches the processes between different steps, and all must stop (and save) at the same step or their
  collectives would mismatch.

  One process decides alone, every step. Several agree through a collective (which waits for the step the devices
  run) at steps all of them know: each agreement also fixes the next one, process 0's measured step time making it
  about AGREE_EVERY_S seconds later, so a preemption's grace period is never spent waiting for log_every steps."""

  def __init__(self, every_minutes: float):
    self.raised = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)
    self._ctrl_c = ctrl_c.CtrlC(self._interrupted)  # the first Ctrl-C as SIGTERM; a second aborts at once
    self._save_every_s = 60.0 * every_minutes
    self._saved_at = time.monotonic()
    self._next = 1  # the next step to agree at (several processes)
    self._step_s = None

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint at the current step, then stopping.")
    self.raised = True

  def _interrupted(self):
    logging.warning(
      "Ctrl-C received: saving a checkpoint at the current step, then stopping (Ctrl-C again stops at once, "
      "without saving)."
    )
    self.raised = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)
    self._ctrl_c.restore()

  def saved(self) -> None:
    """A checkpoint was saved (by step count or time): the save clock starts again."""
    self._saved_at = time.monotonic()

  def rewound(self, step: int) -> None:
    """A rollback restored `step`: the next agreement is at the next step (every process rolled back at the same
    step, so all agree on it), and the save clock starts again from the restored checkpoint."""
    self._next = step + 1
    self.saved()

  def read(self, step_s: float | None) -> None:
    """A step's metrics were read, with the host's measure of its time (None: not a plain step)."""
    self._step_s = step_s or self._step_s

  def at(self, step: int) -> tuple[bool, bool]:
    """(stop, save) at `step`: SIGTERM reached some process; some process's save clock ran out."""
    save_due = bool(self._save_every_s) and time.monotonic() - self._saved_at >= self._save_every_s
    if jax.process_count() == 1:
      return self.raised, save_due
    if step < self._next:
      return False, False
    interval = max(1, int(AGREE_EVERY_S / self._step_s)) if self._step_s else 1
    votes = multihost_utils.process_allgather(np.array([self.raised, save_due, interval], np.int64))
    self._next = step + int(votes[0, 2])  # process 0's proposal: every process takes the same
    return bool(votes[:, 0].any()), bool(votes[:, 1].any())
