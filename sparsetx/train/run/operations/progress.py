"""The run's progress, told as each step is read: the watchdog's clock, goodput's step reached (and its record every
config.train.log_every steps), and the first step's line (how long the start and its compile took).

More: docs/modules.md.
"""

import time

import jax
from absl import logging

from sparsetx.train.run.operation import Operation


class Progress(Operation):
  """Each step read resets the watchdog and advances goodput; the first one also writes startup/* and one line."""

  def after_read(self, run, step: int, step_s: float | None) -> None:
    run.watchdog.progress(step, step_s)
    run.clock.reached(step)
    if step % run.config.train.log_every == 0:
      run.clock.save()  # a run that dies later leaves this record: its restart counts what came after as lost
    if "first_step_seconds" in run.startup:
      return
    run.startup["first_step_seconds"] = time.time() - run.started
    if run.resumed:  # what a restart costs: the start, the restore and the compile, to the first step
      run.clock.measured("restart_seconds", run.startup["first_step_seconds"])
    run.logs.writer.write_scalars(step, {f"startup/{k}": v for k, v in run.startup.items()})
    if jax.process_index() == 0:
      logging.info(
        "Step %d finished %.1f s after the start; its compile took %.1f s.",
        step,
        run.startup["first_step_seconds"],
        run.startup["compile_seconds"],
      )
