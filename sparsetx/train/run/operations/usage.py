"""The loop's reader of the sparse layers' usage window (sparsetx/train/tracking/usage_window.py): every
config.train.usage_window steps and at the last."""

from sparsetx.train.run.operation import Operation
from sparsetx.train.tracking import usage_window


class UsageWindow(Operation):
  def __init__(self, run):
    n_devices = usage_window.devices(run.config, run.built.mesh)  # the device load's split, on the run's mesh
    self.reader = usage_window.Reader(run.config.model, run.built.shardings.usage, run.workdir, n_devices)
    self.every = usage_window.window(run.config.train)

  def after_step(self, run, metrics: dict) -> None:
    if run.state.usage and (run.step % self.every == 0 or run.step == run.steps):
      run.state = self.reader.read(run.step, run.state, run.logs.writer)
