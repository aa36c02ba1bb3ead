"""The run's saves: a failed asynchronous save stops the run before another step; a step is saved every
config.checkpoint.every steps, at the last, and when the processes agree on a stop or a save by time.

More: docs/modules.md.
"""

import time

from sparsetx.train.run.operation import Operation


def save(run, what: str) -> None:
  """Saves `run.step` (its blocking part: the wait for the previous save and the copy off the devices)."""
  run.watchdog.doing(what, "save")
  run.clock.part("checkpoint")
  began = time.monotonic()
  run.checkpointer.save(run.step, run.state, run.config, run.data.state())
  took = time.monotonic() - began
  run.watchdog.measured("save", took)
  run.clock.measured("save_seconds", took)
  run.clock.save()
  run.logs.reader.exclude(took)
  run.watchdog.progress()
  run.logs.reader.saved_step = run.step
  run.agreement.saved()


class CheckSaved(Operation):
  """A save that failed (in the background) stops the run before another step."""

  def after_step(self, run, metrics: dict) -> None:
    run.checkpointer.check_saved()


class AgreeAndSave(Operation):
  """Agrees with the other processes on a stop (SIGTERM, Ctrl-C) and a save by time, saves when due, and ends the
  run at its last step or an agreed stop."""

  def after_read(self, run, step: int, step_s: float | None) -> None:
    run.agreement.read(step_s)

  def after_step(self, run, metrics: dict) -> None:
    last = run.step == run.steps
    stop, save_by_time = (False, False) if last else run.agreement.at(run.step)
    if run.step % run.config.checkpoint.every == 0 or last or stop or save_by_time:
      run.logs.reader.read()  # waits for the step: save only a state known finite, before the next takes its buffers
      save(run, f"saving step {run.step}")
    if last or stop:
      run.logs.reader.read()
      run.stopping = True
