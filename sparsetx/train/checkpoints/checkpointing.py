"""Orbax checkpoints of the train state, the config and the data stream's position, three items of one step.

Each step directory is written by an async `CheckpointManager` and becomes visible only once
complete (orbax's atomic finalize), so a run killed mid-save resumes from the previous one, and every complete
step has its data position (`data`: the stream's step and fingerprint, see sparsetx/data/global_stream.py).
A step-0 start (sparsify, HF import) has none: its stream starts at the beginning.

More: docs/modules.md, sparsetx/train/checkpoints/checkpointing.py.
"""

import time

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.data import check_training_files
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import held_errors
from sparsetx.train.checkpoints.checks import Checks
from sparsetx.train.checkpoints.held_errors import warnings_held_back
from sparsetx.train.checkpoints.items import SUPERSEDED, CheckpointError, item_handlers  # noqa: F401 (callers catch it here)
from sparsetx.train.checkpoints.restoring import Restoring
from sparsetx.train.checkpoints.saved_config import config_from_saved  # noqa: F401 (the package's reader of a config)


class Checkpointer(Checks, Restoring):
  """The run's checkpoints: saves (asynchronous, one under way at a time), the keep policy (orbax's max_to_keep
  and keep_period; the steps after a restore_step set aside), the checks before a resume (Checks) and the restores
  (Restoring). `step_flag` is the flag that picks another saved step, named when a step cannot be read."""

  def __init__(
    self, workdir: str, checkpoint: ml_collections.ConfigDict, step_flag: str = "--config.checkpoint.restore_step"
  ):
    self.step_flag = step_flag
    self.directory = paths.resolve(workdir) / "checkpoints"  # local, or a URL such as gs://bucket/run
    options = ocp.CheckpointManagerOptions(
      max_to_keep=checkpoint.keep,
      keep_period=checkpoint.keep_period or None,
      enable_async_checkpointing=checkpoint.async_save,
      create=True,
    )
    self._saving = None  # (step, HeldErrors) of the save under way
    self._failed_save = None  # the step whose save failed: orbax's manager raises it again on close
    with warnings_held_back() as self._held:  # about a damaged step, if any: released once it is verified
      self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=item_handlers())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def set_aside_after(self, step: int) -> list[int]:
    """Moves the saved steps after `step` to <workdir>/superseded/<time>/checkpoints/, so a run
    resumed from an older `restore_step` saves its own steps there; returns the steps moved."""
    if jax.process_count() > 1:  # every process lists the steps before process 0 moves any
      multihost_utils.sync_global_devices("checkpoint_set_aside_list")
    later = [s for s in self.manager.all_steps() if s > step]
    if later and jax.process_index() == 0:
      target = self.directory.parent / SUPERSEDED / time.strftime("%Y%m%d-%H%M%S")
      (target / "checkpoints").mkdir(parents=True, exist_ok=True)
      for s in later:
        (self.directory / str(s)).rename(target / "checkpoints" / str(s))
      logging.warning("Resuming from step %d: the later steps %s were moved to %s.", step, later, target)
    if jax.process_count() > 1:  # moved before any process saves
      multihost_utils.sync_global_devices("checkpoint_set_aside")
    if later:
      self.manager.reload()
    return later

  def save(self, step: int, state, config: ml_collections.ConfigDict, data_state: dict | None) -> None:
    """Saves `step` (asynchronously with config.checkpoint.async_save); `data_state` None for a step-0 start,
    `state` None for one whose state item is written apart (train/checkpoints/param_writer.py). A failed save, this one or the
    one before it, raises a one-line `paths.StorageError` (see `check_saved`)."""
    self.check_saved(wait=True)
    items = dict(config=ocp.args.JsonSave(config.to_dict()))
    if state is not None:
      items["state"] = ocp.args.StandardSave(state)
    if data_state is not None:
      items["data"] = ocp.args.JsonSave(data_state)
    self._saving = step, self._holding_echoes(step, reported=paths.StorageError).install()
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as error:  # noqa: BLE001  (any failure of the save, reported with its own words)
      self._save_failed(error)
    self.check_saved()

  def check_saved(self, wait: bool = False) -> None:
    """Raises the one-line `paths.StorageError` of the save under way once it has ended in failure (a loop calls
    this every step, so no step runs after a failure is known); with `wait`, waits for the save to end first."""
    if self._saving is None or not wait and self.manager.is_saving_in_progress():
      return
    try:
      self.manager.wait_until_finished()  # raises the save's failure (orbax's save finalize ends with it)
    except Exception as error:  # noqa: BLE001
      self._save_failed(error)
    _, held = self._saving
    self._saving = None
    held.remove()

  def _save_failed(self, error: BaseException) -> None:
    step, held = self._saving
    self._saving, self._failed_save = None, step
    words = paths.cause(error)
    message = f"saving checkpoint step {step} in {self.directory} failed ({words})"
    held_errors.drop_frames(error)
    held.settle()
    held.remove(drop_echoes=True)
    raise paths.StorageError(f"{message}; {paths.fitting(self.newest_complete(), words)}") from None

  def newest_complete(self) -> str:
    """Which complete step a rerun resumes from, and what to do first: the end of a failed write's one line."""
    self.manager.reload()
    steps = sorted(self.manager.all_steps())
    if not steps:
      return f"no checkpoint is complete yet: {paths.FREE_SPACE}."
    return (
      f"the newest complete checkpoint is step {steps[-1]} (nothing saved was damaged): {paths.FREE_SPACE} to "
      "resume from it."
    )

  def wait(self) -> None:
    """Waits for the save under way; raises its `paths.StorageError` if it failed."""
    self.check_saved(wait=True)

  def close(self) -> None:
    """Waits for the save under way (its failure raised as a `paths.StorageError`), then closes the manager."""
    self._held.release()
    self.check_saved(wait=True)
    if self._failed_save is None:
      self.manager.close()


def open_read_only(workdir: str, workdir_flag: str = "--workdir", step_flag: str = "--step") -> Checkpointer:
  """A Checkpointer for reading a trained run (evaluation, export, analysis): it never deletes a step.
  `step_flag` picks the step (named when one cannot be read)."""
  if not (paths.resolve(workdir) / "checkpoints").is_dir():
    raise ConfigError(
      f"{workdir_flag}={workdir!r} holds no checkpoints/ directory; give the workdir of a training run."
    )
  return Checkpointer(workdir, ml_collections.ConfigDict(dict(keep=None, keep_period=0, async_save=False)), step_flag)


def load(
  workdir: str,
  step: int | None = None,
  mesh=None,
  *,
  adjust=None,
  full_state: bool = False,
  workdir_flag: str = "--workdir",
  step_flag: str = "--step",
):
  """(config, params, step) of the checkpoint at `step` (default: the latest) of a training workdir: the one
  reader of trained runs (evaluation, analysis, sparsify, export).

  The saved config goes through `adjust` (a function that edits it in place: a task list, a dtype, the mesh)
  and is validated with its files checked; the parameters are read onto `mesh`: a jax Mesh, a function of the
  config that builds one, or None for the first device alone. `full_state` reads the step's whole train state
  as the trainer restores it (a damaged array of any part is reported as one line, nothing printed after it)
  and keeps its params; otherwise only the params are read (an optimizer state of another structure is fine).
  An unreadable step is refused with its `CheckpointError` (naming `step_flag`), parameters that do not fit
  the saved config with a ConfigError.
  """
  checkpointer = open_read_only(workdir, workdir_flag, step_flag)
  try:
    step = checkpointer.checked_step(step, workdir_flag)
    config = checkpointer.saved_config(step)
    if adjust is not None:
      adjust(config)
    check_training_files(config_lib.validate(config))
    if mesh is None:
      mesh = state_lib.single_device_mesh(config)
    elif not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):  # (a Mesh is callable itself)
      mesh = mesh(config)
    abstract, _, _, _ = state_lib.state_shardings(config, mesh)
    try:
      if full_state:
        params = checkpointer.restore_state(step, abstract).params
      else:
        params = checkpointer.restore_params(step, abstract.params)
    except ConfigError:  # a damaged step (CheckpointError): reported as it is
      raise
    except (ValueError, KeyError, TypeError) as error:
      raise ConfigError(
        f"the checkpoint at step {step} in {checkpointer.directory} does not match the model of its own config "
        f"({error}); it was written by another version of the model code."
      ) from error
  finally:
    checkpointer.close()
  return config, params, step
