"""A trainer on slow storage and a slow first evaluation, for the watchdog's tests: `python -m slow_storage` with
tests/ on PYTHONPATH and sparsetx-train's flags. Each SPARSETX_TEST_SLOW_* variable (seconds) slows one thing:
SAVE the first save call, WAIT every wait for a save (the last save's and a rollback's), RESTORE every restore of a
train state, EVAL the first evaluation batch. Poisoned batches as tests/poisoned_stream.py reads them."""

import functools
import os
import time

import poisoned_stream

from sparsetx.data import global_stream
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing


def _slowed(method, seconds: float, times: int | None = None):
  """`method` that first sleeps `seconds`, on its first `times` calls (None: every call)."""
  calls = []

  @functools.wraps(method)
  def slow(*args, **kwargs):
    if times is None or len(calls) < times:
      calls.append(1)
      time.sleep(seconds)
    return method(*args, **kwargs)

  return slow


def _seconds(name: str) -> float:
  return float(os.environ.get(f"SPARSETX_TEST_SLOW_{name}", 0))


if __name__ == "__main__":
  Checkpointer = checkpointing.Checkpointer
  if _seconds("SAVE"):
    Checkpointer.save = _slowed(Checkpointer.save, _seconds("SAVE"), times=1)
  if _seconds("WAIT"):
    Checkpointer.wait = _slowed(Checkpointer.wait, _seconds("WAIT"))
  if _seconds("RESTORE"):
    Checkpointer.restore_state = _slowed(Checkpointer.restore_state, _seconds("RESTORE"))
  if _seconds("EVAL"):
    make_eval_step = step_lib.make_eval_step
    step_lib.make_eval_step = lambda *a, **k: _slowed(make_eval_step(*a, **k), _seconds("EVAL"), times=1)
  make_stream = global_stream.GlobalStream
  spikes = [int(s) for s in os.environ.get("SPARSETX_TEST_SPIKES", "").split(",") if s]
  global_stream.GlobalStream = lambda *a, **k: poisoned_stream.Poisoned(make_stream(*a, **k), spikes, ())
  from sparsetx.tools import train

  train.main()
