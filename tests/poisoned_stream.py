"""A train stream with poisoned batches at known steps of the stream (1-based, config.data.skip_steps's numbering):
a spike (every target the byte id 258, which no text holds: a large, finite loss) or a NaN (loss weights times NaN:
a non-finite loss and update).

In the test's process: `install(monkeypatch, spikes, nans)`. In a trainer's process (`python -m poisoned_stream`,
with tests/ on PYTHONPATH, as sparsetx-train's flags; launch_local's --module=poisoned_stream): the steps come from
SPARSETX_TEST_SPIKES and SPARSETX_TEST_NANS ("12,13").
"""

import os

import numpy as np

from sparsetx.data import global_stream

RARE_ID = 258


class Poisoned:
  def __init__(self, inner, spikes, nans):
    self._inner, self._spikes, self._nans = inner, set(spikes), set(nans)

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def __setattr__(self, name, value):
    if name.startswith("_"):
      object.__setattr__(self, name, value)
    else:
      setattr(self._inner, name, value)

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._inner)
    step = self._inner.step  # the batch just read trains this step of a run that skips nothing
    if step in self._spikes:
      batch = dict(batch, targets=batch["targets"] * 0 + RARE_ID)
    if step in self._nans:
      batch = dict(batch, loss_weights=batch["loss_weights"] * np.float32(np.nan))
    return batch


def install(monkeypatch, spikes=(), nans=()) -> None:
  make_stream = global_stream.GlobalStream
  monkeypatch.setattr(global_stream, "GlobalStream", lambda *a, **k: Poisoned(make_stream(*a, **k), spikes, nans))


def _steps(name: str) -> list[int]:
  return [int(s) for s in os.environ.get(name, "").split(",") if s]


if __name__ == "__main__":
  make_stream = global_stream.GlobalStream
  spikes, nans = _steps("SPARSETX_TEST_SPIKES"), _steps("SPARSETX_TEST_NANS")
  global_stream.GlobalStream = lambda *a, **k: Poisoned(make_stream(*a, **k), spikes, nans)
  from sparsetx.tools import train

  train.main()
