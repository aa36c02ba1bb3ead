"""perf/timing.py, the harness every benchmark times with: one untimed call each, then rounds that run every call
once in turn, and the median of each call's rounds."""

import time

import jax.numpy as jnp
import pytest

from sparsetx.perf import timing


def test_interleaved_warms_each_call_then_runs_them_in_turn():
  order = []
  calls = {name: (lambda name=name: order.append(name) or jnp.zeros(())) for name in ("a", "b", "c")}
  medians = timing.interleaved(calls, rounds=3)
  assert order == ["a", "b", "c"] * 4  # the untimed call of each, then three rounds
  assert list(medians) == ["a", "b", "c"] and all(s >= 0 for s in medians.values())
  order.clear()
  timing.interleaved(calls, rounds=2, warm=False)
  assert order == ["a", "b", "c"] * 2


def test_interleaved_takes_the_median_round(monkeypatch):
  # Each call's rounds take 5, 1 and 3 clock ticks: the median is 3, whatever the order.
  ticks = iter([0, 5, 5, 6, 6, 9])
  monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
  assert timing.interleaved({"only": lambda: None}, rounds=3, warm=False) == {"only": 3}


def test_interleaved_needs_a_round():
  with pytest.raises(ValueError, match="rounds=0"):
    timing.interleaved({"a": lambda: None}, rounds=0)


def test_stopwatch_spans_its_block():
  with timing.Stopwatch() as clock:
    time.sleep(0.01)
  assert clock.seconds >= 0.01
