"""The hang watchdog: a run in which nothing finishes (a step, an evaluation batch, a checkpoint's save call) within
config.train.step_timeout_s ends with every thread's stack in its log, one `error:` line and WATCHDOG_EXIT_CODE,
which the deploy/ recipes restart on (the restart resumes from the newest checkpoint).

More: docs/modules.md, sparsetx/train/watchdog.py.
"""

import collections
import faulthandler
import os
import sys
import threading
import time

WATCHDOG_EXIT_CODE = 6
FLOOR_S = 300.0  # the derived timeout's least value: longer than JAX's heartbeat timeout (100 s), see docs
STEP_FACTOR = 20.0  # the derived timeout: this many times the slowest of the last measured steps
MEASURED = 100  # steps whose times the derived timeout reads


def timeout_words(setting) -> str:
  return f"config.train.step_timeout_s={setting}" if setting else "the derived step timeout"


class Watchdog:
  """Armed by the first finished step (its compile is not timed); `progress` after each step, evaluation batch and
  save call; `doing` names what runs (the error line says it)."""

  def __init__(self, setting: float | None, process: int = 0):
    """`setting`: seconds, 0 (off) or None (derived: max(FLOOR_S, STEP_FACTOR x the slowest measured step))."""
    self._setting, self._process = setting, process
    self._steps_s = collections.deque(maxlen=MEASURED)
    self._last, self._last_step, self._doing = time.monotonic(), None, "the first step"
    self._armed = False
    self._stop = threading.Event()
    self._thread = None
    if setting != 0:
      self._thread = threading.Thread(target=self._watch, name="sparsetx-watchdog", daemon=True)
      self._thread.start()

  def limit(self) -> float:
    if self._setting:
      return float(self._setting)
    return max(FLOOR_S, STEP_FACTOR * max(self._steps_s, default=0.0))

  def progress(self, step: int | None = None, step_s: float | None = None) -> None:
    """Something finished: `step` (with its time `step_s` when it is a plain step: no compile, save or evaluation
    inside it), or an evaluation batch or a save call (no arguments)."""
    now = time.monotonic()
    if step is not None:
      self._last_step, self._armed = step, True
      if step_s is not None:
        self._steps_s.append(step_s)
    self._last = now

  def doing(self, what: str) -> None:
    """What runs now, for the error line ('step 120', 'the evaluation after step 100', 'saving step 200')."""
    self._doing = what
    self._last = time.monotonic()

  def close(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(5.0, self.limit() / 4)):
      waited = time.monotonic() - self._last
      if self._armed and waited > self.limit():
        self._fire(waited)

  def _fire(self, waited: float) -> None:
    """Writes every thread's stack and one line to stderr, then ends the process at once (a hung collective or read
    would never return to let it end otherwise)."""
    sys.stderr.write(f"\nsparsetx watchdog, process {self._process}: the stacks of all threads:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.write(
      f"error: process {self._process}: nothing finished for {waited:.0f} s ({timeout_words(self._setting)}: "
      f"{self.limit():.0f} s) while running {self._doing}; the last finished step is {self._last_step}. A peer or "
      "a read hangs; the stacks are in the log above. Exiting with code "
      f"{WATCHDOG_EXIT_CODE}: run the same command again to resume from the newest checkpoint.\n"
    )
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT_CODE)
