"""The one timing harness of every benchmark: calls timed side by side in interleaved rounds, and a stopwatch.

Each call runs once untimed (its compile and first transfers), then every round runs each call once in turn, so
drift and noise hit all of them alike and the ratios a benchmark prints compare like with like. A call's time
ends when its outputs are ready (`jax.block_until_ready`); host work and one-off jobs take the stopwatch.
"""

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax


class Stopwatch:
  """`with Stopwatch() as clock: ...`, then `clock.seconds`: the wall time of the block."""

  seconds: float = 0.0

  def __enter__(self) -> "Stopwatch":
    self._start = time.perf_counter()
    return self

  def __exit__(self, *exc) -> None:
    self.seconds = time.perf_counter() - self._start


def seconds(call: Callable[[], Any]) -> float:
  """Wall seconds of one call, until its outputs are ready."""
  with Stopwatch() as clock:
    jax.block_until_ready(call())
  return clock.seconds


def interleaved(calls: dict[Hashable, Callable[[], Any]], rounds: int, warm: bool = True) -> dict[Hashable, float]:
  """Each call's median seconds over `rounds` rounds that run every call once, in turn (after one untimed call
  each unless `warm` is False, where the caller has made it)."""
  if rounds < 1:
    raise ValueError(f"rounds={rounds}: time at least one round.")
  if warm:
    for call in calls.values():
      jax.block_until_ready(call())
  times = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      times[name].append(seconds(call))
  return {name: statistics.median(t) for name, t in times.items()}
