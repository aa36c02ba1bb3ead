"""Where the trainer's wall time went (MaxText's goodput and badput): every moment from the trainer's start to its
end belongs to exactly one part, so the parts add up to the wall time; the totals are cumulative over the restarts of
one workdir (<workdir>/goodput.json, rewritten before the first step, every log interval, every save and at the end).
A start after a run killed, hung or preempted counts the time since that run's record as lost, and the steps it
repeats as redone. The record also keeps the measured costs a save cadence is planned from
(sparsetx/plan/save_cadence.py). Writing it never ends a run: a failed write is one warning.

More: docs/modules.md, sparsetx/train/run/goodput.py.
"""

import collections
import json
import math
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
  "lost": "lost to kills, hangs and preemptions",
}
COSTS = ("save_seconds", "restore_seconds", "restart_seconds")
COSTS_KEPT = 20  # the newest measurements of each cost the record keeps
STATUSES = ("running", "stopped", "failed", "finished")
LOST_AFTER = ("running", "stopped")  # a start after a record of these counts the time since it as lost


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def check_record(record) -> str | None:
  """What is wrong with a goodput record (None: nothing), so a damaged one is set aside, never trusted."""
  if not isinstance(record, dict):
    return "not a JSON object"
  seconds = record.get("seconds", {})
  if not isinstance(seconds, dict) or not all(_number(v) for v in seconds.values()):
    return "`seconds` is not {part: seconds}"
  for field in ("wall", "reached", "runs", "productive_steps", "written_at"):
    if field in record and not _number(record[field]):
      return f"`{field}` is {record[field]!r}, not a number >= 0"
  if record.get("status", "finished") not in STATUSES:
    return f"`status` is {record.get('status')!r}, not one of {', '.join(STATUSES)}"
  costs = record.get("costs", {})
  if not isinstance(costs, dict):
    return "`costs` is not an object"
  for name in COSTS:
    if not isinstance(costs.get(name, []), list) or not all(_number(v) for v in costs.get(name, [])):
      return f"`costs.{name}` is not a list of seconds"
  return None


class Goodput:
  """`part(name)` switches the clock to a part; `stepping(step)` to the productive or the redone steps."""

  def __init__(self, workdir: str, started: float):
    """`started`: time.time() at the trainer's start. Parts are timed on the monotonic clock (a clock step during a
    save must not make a negative part); the wall clock only dates the record and finds the gap to the last one."""
    self._path = paths.resolve(workdir) / RECORD
    self._previous = self._read()
    self._reached = int(self._previous.get("reached", 0))  # the last step any run of the workdir finished
    self._started = time.monotonic() - max(0.0, time.time() - started)
    self._mark, self._part = self._started, "init"
    self._seconds = dict.fromkeys(PARTS, 0.0)
    self._productive = int(self._previous.get("productive_steps", self._reached))
    costs = self._previous.get("costs", {})
    self._costs = {name: collections.deque(costs.get(name, []), maxlen=COSTS_KEPT) for name in COSTS}
    self._status = "running"
    self._failed_write = False
    self.written = False  # whether this run wrote (or tried to write) its record
    if self._previous.get("status") in LOST_AFTER and "written_at" in self._previous:
      self._seconds["lost"] = max(0.0, started - float(self._previous["written_at"]))

  def _read(self) -> dict:
    try:
      record = json.loads(self._path.read_text()) if self._path.exists() else {}
    except (ValueError, UnicodeDecodeError, *paths.storage_errors()) as error:
      record, problem = {}, paths.reason(error)
    else:
      problem = check_record(record)
    if problem:
      logging.warning(
        "%s is damaged (%s): goodput counts from this run on, and the next write replaces it.", self._path, problem
      )
      return {}
    return record

  def part(self, name: str) -> float:
    """Switches the clock to `name`; returns the monotonic time of the switch."""
    now = time.monotonic()
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
    """One save_seconds (a save's blocking time), restore_seconds or restart_seconds (a resumed start's time to its
    first step), measured on the monotonic clock."""
    self._costs[cost].append(max(0.0, seconds))

  def stopped_as(self, status: str) -> None:
    """How this run stops: finished (its steps done), stopped (SIGTERM) or failed."""
    self._status = status

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
    """Rewrites the workdir's record (process 0): what a later run adds to. A failed write is a warning (once until
    a write succeeds again): the accounting is not worth a run."""
    totals = self.totals()
    self.written = True
    if jax.process_index() != 0:
      return
    record = dict(
      seconds={name: totals[name] for name in PARTS},
      wall=totals["wall"],
      reached=self._reached,
      productive_steps=self._productive,
      runs=int(self._previous.get("runs", 0)) + 1,
      written_at=time.time(),
      status=self._status,
      costs=dict(
        {name: list(values) for name, values in self._costs.items()},
        step_seconds=totals["steps"] / self._productive if self._productive else None,
      ),
    )
    try:
      paths.write_text_atomically(self._path, json.dumps(record, indent=2) + "\n")
    except paths.storage_errors() as error:
      if not self._failed_write:
        logging.warning(
          "Writing %s failed (%s); the run goes on, and the next write tries again.", self._path, paths.reason(error)
        )
      self._failed_write = True
    else:
      self._failed_write = False

  def table(self) -> str:
    """The table printed at exit: each part's seconds and share of the wall time, over every run of the workdir."""
    totals = self.totals()
    runs = int(self._previous.get("runs", 0)) + 1
    lines = [f"Where the time went ({runs} run{'s' if runs > 1 else ''} of this workdir, {totals['wall']:,.1f} s):"]
    for name in PARTS:
      lines.append(f"  {WORDS[name]:<44}{totals[name]:>10,.1f} s{totals[name] / max(totals['wall'], 1e-9):>8.1%}")
    return "\n".join(lines)
