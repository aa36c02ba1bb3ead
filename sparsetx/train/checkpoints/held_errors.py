"""The echoes of a failed checkpoint read or save, held while one step is read or written, dropped only when it fails.

Orbax reads and writes a step through many asyncio tasks; when one fails, the one failure comes back many times
over (unraisable 'Event loop is closed' tracebacks, asyncio's 'Task exception was never retrieved', orbax's own
log), while the caller's one line already says what failed. `HeldErrors` is installed for one read or save and
removed after it: it holds unraisable errors and asyncio's and absl's error records, releases them all as they came
unless the operation fails with the caller's one-line error, and then drops only that failure's echoes (a
completion posted to the closed loop, errors naming the step's own directory). docs/modules.md says more.
"""

import contextlib
import gc
import logging
import os
import re
import sys
import threading
import time
import traceback

import orbax.checkpoint as ocp
from absl import logging as absl_logging

SETTLE_QUIET_S = 0.2  # the stragglers of a failed read or save arrive within milliseconds of each other
SETTLE_LIMIT_S = 3.0
CLOSED_LOOP = "Event loop is closed"


def _chain(error: BaseException | None) -> list[BaseException]:
  """`error` and the errors it was raised from or during."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    error = error.__cause__ or error.__context__
  return seen


def _posted_to_closed_loop(error: BaseException) -> bool:
  """The RuntimeError asyncio raises when another thread posts a completion to a loop that is closed."""
  frames = traceback.extract_tb(error.__traceback__)
  return (
    isinstance(error, RuntimeError)
    and str(error) == CLOSED_LOOP
    and any(frame.name == "call_soon_threadsafe" for frame in frames)
  )


def drop_frames(error: BaseException) -> None:
  """Lets the collector reach what a failure still holds (orbax's tasks, its closed loop): the frames of `error`'s
  traceback and of those of the errors it was raised from or during are cleared (their locals, not their lines)."""
  for each in _chain(error):
    traceback.clear_frames(each.__traceback__)


class HeldErrors(logging.Filter):
  """Holds the error output of one read or save of the step in `step_dir`; `reported` is the type of the caller's
  one-line error (a context manager for a read; `install` and `remove` for an asynchronous save)."""

  def __init__(self, step_dir: str, reported: type[BaseException]):
    super().__init__()
    self._step = re.compile(re.escape(step_dir.rstrip("/")) + r"(?![0-9])")  # step 1 is not step 10
    self._reported = reported
    self._held = []  # (logger, record) or (None, unraisable), in the order they came
    self._lock = threading.Lock()
    self._last = time.monotonic()
    self._previous_hook = None

  def install(self) -> "HeldErrors":
    self._previous_hook = sys.unraisablehook
    sys.unraisablehook = self._hold_unraisable
    for logger in self._loggers():
      logger.addFilter(self)
    return self

  def remove(self, drop_echoes: bool = False) -> None:
    """Uninstalls; releases what was held (but the echoes of the step's failure with `drop_echoes`)."""
    for logger in self._loggers():
      logger.removeFilter(self)
    if sys.unraisablehook == self._hold_unraisable:
      sys.unraisablehook = self._previous_hook
    with self._lock:
      held, self._held = self._held, []
    previous, self._previous_hook = self._previous_hook, None  # a hook installed above this one passes through
    for logger, item in held:
      if logger is None:
        if not (drop_echoes and self.is_echo(item.exc_value)):
          previous(item)
      elif not (drop_echoes and self.is_echo(item.exc_info[1] if item.exc_info else None, item.getMessage())):
        logger.handle(item)

  def settle(self) -> None:
    """Waits for the stragglers of a failure: the collector's run, then a quiet moment (bounded)."""
    gc.collect()
    start = time.monotonic()
    with self._lock:
      self._last = max(self._last, start)
    while time.monotonic() - start < SETTLE_LIMIT_S:
      with self._lock:
        quiet = time.monotonic() - self._last
      if quiet >= SETTLE_QUIET_S:
        return
      time.sleep(SETTLE_QUIET_S - quiet)

  def is_echo(self, error: BaseException | None, text: str = "") -> bool:
    """An echo of this step's failure: a completion posted to its closed loop, or an error naming the step."""
    if error is not None and _posted_to_closed_loop(error):
      return True
    return bool(self._step.search(text) or any(self._step.search(str(e)) for e in _chain(error)))

  def __enter__(self) -> "HeldErrors":
    return self.install()

  def __exit__(self, error_type, error, tb) -> None:
    failed = isinstance(error, self._reported)
    if failed:
      drop_frames(error)
      self.settle()
    self.remove(drop_echoes=failed)

  def filter(self, record: logging.LogRecord) -> bool:
    """A logger's filter: errors are held (False: not logged now), the rest pass."""
    if record.levelno < logging.ERROR:
      return True
    self._keep(logging.getLogger(record.name), record)
    return False

  def _hold_unraisable(self, unraisable) -> None:
    if self._previous_hook is None:  # removed, but another hook installed after this one still calls it
      sys.__unraisablehook__(unraisable)
      return
    self._keep(None, unraisable)

  def _keep(self, logger, item) -> None:
    with self._lock:
      self._held.append((logger, item))
      self._last = time.monotonic()

  @staticmethod
  def _loggers() -> list[logging.Logger]:
    return [logging.getLogger("asyncio"), absl_logging.get_absl_logger()]


ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__))  # the records HeldWarnings may hold


class HeldWarnings(logging.Filter):
  """Keeps back orbax's WARNING records (orbax logs through absl) logged while it is installed; every other record,
  an ERROR or another library's warning, passes at once."""

  def __init__(self):
    super().__init__()
    self.records = []

  def filter(self, record):
    if record.levelno != logging.WARNING or ORBAX_DIR not in os.path.abspath(record.pathname):
      return True
    self.records.append(record)
    return False

  def release(self) -> None:
    for record in self.records:
      absl_logging.get_absl_logger().handle(record)
    self.records = []


@contextlib.contextmanager
def warnings_held_back():
  """Orbax's warnings while a step is checked ('Metadata file does not exist', 'Item "state" was found in the
  checkpoint, but could not be restored') are dropped when the check fails: its one line says what is wrong.
  The caller releases them when the check passes."""
  held = HeldWarnings()
  absl_logging.get_absl_logger().addFilter(held)
  try:
    yield held
  finally:
    absl_logging.get_absl_logger().removeFilter(held)
