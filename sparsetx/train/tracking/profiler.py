"""A jax.profiler trace of the steps config.train.profile_steps names, under the TensorBoard directory.

More: docs/modules.md.
"""

import jax
import ml_collections
from absl import logging
from etils import epath

from sparsetx import config as config_lib


class Profiler:
  """A jax.profiler trace of the steps config.train.profile_steps=START,COUNT names, written under the
  TensorBoard directory (plugins/profile/<run>/), where TensorBoard's profile plugin finds it. Process 0
  only, or every process with config.train.profile_all_processes."""

  def __init__(self, train: ml_collections.ConfigDict, logdir: epath.Path):
    steps = config_lib.profile_steps(train)
    wanted = steps is not None and (jax.process_index() == 0 or train.get("profile_all_processes", False))
    self._first, self._last = (steps[0], steps[0] + steps[1] - 1) if wanted else (0, -1)
    self._logdir, self._active = logdir, False

  def before(self, step: int) -> None:
    if self._first <= step <= self._last and not self._active:  # a resumed run traces what is left
      self._logdir.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self._logdir))
      self._active = True

  def after(self, step: int, metrics: dict) -> None:
    if self._active and step == self._last:
      jax.block_until_ready(metrics)  # the trace holds the last step's device work
      self.close()
      self._first = self._last + 1
      logging.info("Profile of steps up to %d written under %s/plugins/profile.", step, self._logdir)

  def close(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
