"""The loop's profiler: a jax.profiler trace (sparsetx/train/tracking/profiler.py) started before the first step of
config.train.profile_steps and stopped after the last."""

from sparsetx.train.run.operation import Operation
from sparsetx.train.tracking import metrics as metrics_lib
from sparsetx.train.tracking import profiler


class Profile(Operation):
  def __init__(self, run):
    self.profiler = profiler.Profiler(run.config.train, metrics_lib.tensorboard_dir(run.workdir))

  def before_step(self, run) -> None:
    self.profiler.before(run.step + 1)

  def after_step(self, run, metrics: dict) -> None:
    self.profiler.after(run.step, metrics)

  def at_exit(self, run) -> None:
    self.profiler.close()
