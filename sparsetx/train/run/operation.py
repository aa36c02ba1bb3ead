"""What the loop's operations share: the run in progress (`Run`: its state, step, batch and services) and the hook
interface each operation implements (`Operation`), in the manner of Levanter's trainer hooks.

An operation is one thing the run does around its steps (read metrics, evaluate, save, profile); the loop calls
each operation's hooks in the order of its list, so adding one is its file and its entry in loop.OPERATIONS (with
its import). More: docs/modules.md.
"""

import dataclasses

import ml_collections


@dataclasses.dataclass
class Run:
  """The run in progress: what it set up (config, built, workdir), its services (the checkpointer, the data stream,
  the watchdog, the goodput clock, the agreement, the logs of the current stretch) and where it is (state, step,
  batch, the stream positions of the recent steps' batches)."""

  config: ml_collections.ConfigDict
  workdir: str
  built: object  # state.Setup
  started: float  # the trainer's start (time.time())
  checkpointer: object  # checkpoints.checkpointing.Checkpointer
  data: object  # data.global_stream.GlobalStream
  watchdog: object  # run.watchdog.Watchdog
  clock: object  # run.goodput.Goodput
  agreement: object  # run.agreement.Agreement
  state: object
  step: int
  resumed: bool  # from a checkpoint the run saved (not a fresh state, nor a step-0 start)
  logs: object = None  # run.reading.Logs of the current stretch (a rollback opens new ones)
  batch: object = None  # the next step's batch
  positions: dict = dataclasses.field(default_factory=dict)  # {step: stream position of its batch}, recent steps
  startup: dict = dataclasses.field(default_factory=dict)  # the first step's compile and its end (startup/*)
  stopping: bool = False  # the step just done is the run's last (config.train.steps, or a stop agreed)
  operations: tuple = ()  # the loop's, in order
  step_fn: object = None  # the jitted train step

  def after_read(self, step: int, step_s: float | None) -> None:
    """The step reader's callback: every operation's after_read."""
    each(self.operations, "after_read", self, step, step_s)

  @property
  def steps(self) -> int:
    return self.config.train.steps


class Operation:
  """One thing the run does around its steps. Each hook is a no-op unless overridden; the loop calls them in the
  order of its list."""

  def __init__(self, run: Run):
    del run

  def before_step(self, run: Run) -> None:
    """Before step `run.step + 1` is dispatched."""

  def after_step(self, run: Run, metrics: dict) -> None:
    """After step `run.step` is dispatched (its devices still running); `metrics` its metrics, not yet read."""

  def after_read(self, run: Run, step: int, step_s: float | None) -> None:
    """Step `step`'s metrics were read, with the host's measure of its time (None for the first, which compiled, and
    for one whose interval held an evaluation or a save)."""

  def at_exit(self, run: Run) -> None:
    """The run ends, finished or not (in a `finally`)."""


def each(operations, hook: str, *args) -> None:
  """Calls `hook` of every operation, in order."""
  for operation in operations:
    getattr(operation, hook)(*args)
