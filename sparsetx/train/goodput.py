"""Where the trainer's wall time went (MaxText's goodput and badput): every moment from the trainer's start to its
end belongs to exactly one part, so the parts add up to the wall time; the totals are cumulative over the restarts of
one workdir (<workdir>/goodput.json, rewritten at every log interval, every save and at the end).

A run that ends without finishing (killed, hung, stopped by bad steps) leaves its last record: the next start counts
the time from that record to itself as lost (the work since the record and the wait for the restart), and the steps
it repeats as redone. The record also keeps the measured costs a save cadence is planned from
(sparsetx/plan/save_cadence.py): each blocking save, each restore, each start's time to its first step, the mean step.

More: docs/modules.md, sparsetx/train/goodput.py.
"""

import collections
import json
import time

import jax
from absl import logging

from sparsetx import paths

RECORD = "goodput.json"
PARTS = ("init", "compile", "data_wait", "steps", "redone_steps", "checkpoint", "evaluation", "lost")
WORDS = {
  "init": "init (config, corpus, model, restore)",
  "compile": "compile (the first step's call)",
  "data_wait": "waiting for data",
  "steps": "productive steps",
  "redone_steps": "steps redone after a restore or rollback",
  "checkpoint": "checkpoint saves and restores (blocking)",
  "evaluation": "evaluation",
  "lost": "lost to runs that did not finish",
}
COSTS_KEPT = 20  # the newest measurements of each cost the record keeps


class Goodput:
  """`part(name)` switches the clock to a part; `stepping(step)` to the productive or the redone steps."""

  def __init__(self, workdir: str, started: float):
    self._path = paths.resolve(workdir) / RECORD
    self._previous = self._read()
    self._reached = int(self._previous.get("reached", 0))  # the last step any run of the workdir finished
    self._started, self._mark, self._part = started, started, "init"
    self._seconds = dict.fromkeys(PARTS, 0.0)
    self._productive = int(self._previous.get("productive_steps", self._reached))
    costs = self._previous.get("costs", {})
    self._costs = {
      name: collections.deque(costs.get(name, []), maxlen=COSTS_KEPT)
      for name in ("save_seconds", "restore_seconds", "restart_seconds")
    }
    self._ended = False
    if self._previous and not self._previous.get("ended", True):  # it stopped after its last record
      self._seconds["lost"] = max(0.0, started - float(self._previous.get("written_at", started)))

  def _read(self) -> dict:
    try:
      record = json.loads(self._path.read_text()) if self._path.exists() else {}
    except (ValueError, OSError) as error:
      logging.warning("%s is unreadable (%s): goodput counts from this run on.", self._path, error)
      return {}
    return record if isinstance(record, dict) else {}

  def part(self, name: str) -> float:
    """Switches the clock to `name`; returns the time of the switch."""
    now = time.time()
    self._seconds[self._part] += now - self._mark
    self._part, self._mark = name, now
    return now

  def stepping(self, step: int) -> None:
    """The clock runs for `step` (about to run): redone when some run of the workdir finished it before."""
    self.part("redone_steps" if step <= self._reached else "steps")

  def reached(self, step: int) -> None:
    """`step` finished (a rollback's bad step included: the steps after the restored one are redone)."""
    if step > self._reached:
      self._productive += 1
    self._reached = max(self._reached, step)

  def measured(self, cost: str, seconds: float) -> None:
    """One save_seconds (a save's blocking time), restore_seconds or restart_seconds (a start to its first step)."""
    self._costs[cost].append(seconds)

  def ended(self) -> None:
    """The run finished its steps: the time until a later start (with more steps) is not lost."""
    self._ended = True

  def totals(self) -> dict:
    """{part: seconds} over every run of the workdir, this one up to now, and `wall`."""
    now = self.part(self._part)
    earlier = self._previous.get("seconds", {})
    totals = {name: float(earlier.get(name, 0.0)) + self._seconds[name] for name in PARTS}
    totals["wall"] = float(self._previous.get("wall", 0.0)) + self._seconds["lost"] + now - self._started
    return totals

  def metrics(self) -> dict:
    totals = self.totals()
    scalars = {f"goodput/{name}_seconds": totals[name] for name in PARTS}
    scalars["goodput/goodput"] = totals["steps"] / max(totals["wall"], 1e-9)
    return scalars

  def save(self) -> None:
    """Rewrites the workdir's record (process 0): what a later run adds to."""
    totals = self.totals()
    if jax.process_index() == 0:
      record = dict(
        seconds={name: totals[name] for name in PARTS},
        wall=totals["wall"],
        reached=self._reached,
        productive_steps=self._productive,
        runs=int(self._previous.get("runs", 0)) + 1,
        written_at=time.time(),
        ended=self._ended,
        costs=dict(
          {name: list(values) for name, values in self._costs.items()},
          step_seconds=totals["steps"] / self._productive if self._productive else None,
        ),
      )
      with paths.writing(f"writing {self._path}", paths.FREE_SPACE):
        paths.write_text_atomically(self._path, json.dumps(record, indent=2) + "\n")

  def table(self) -> str:
    """The table printed at exit: each part's seconds and share of the wall time, over every run of the workdir."""
    totals = self.totals()
    runs = int(self._previous.get("runs", 0)) + 1
    lines = [f"Where the time went ({runs} run{'s' if runs > 1 else ''} of this workdir, {totals['wall']:,.1f} s):"]
    for name in PARTS:
      lines.append(f"  {WORDS[name]:<44}{totals[name]:>10,.1f} s{totals[name] / max(totals['wall'], 1e-9):>8.1%}")
    return "\n".join(lines)
