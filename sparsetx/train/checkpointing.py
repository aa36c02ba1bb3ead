"""Orbax checkpoints of the train state, the config and the data iterator's position.

Each step directory is written by an async `CheckpointManager` and becomes visible only once
complete (orbax's atomic finalize), so a run killed mid-save resumes from the previous one. The
data iterator's state (a TensorFlow iterator checkpoint per process, see sparsetx/data/pipeline.py)
is written synchronously to `<workdir>/data_state/<step>` *before* the model save starts, so every
complete model checkpoint has its data state; data states of deleted steps are removed.
"""

import json
import os
import shutil

import jax
import ml_collections
import orbax.checkpoint as ocp

from sparsetx import config as config_lib
from sparsetx.config import ConfigError

COMPUTE_ONLY = ("dtype", "remat", "max_len", "kernel", "implementation")  # may change on resume


def _tuples(value):
  """JSON turns the config's tuples (mixture, sharding rules) into lists; the schema wants tuples."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def _merged(defaults: dict, saved: dict) -> dict:
  return {
      **defaults,
      **{k: _merged(defaults[k], v) if isinstance(defaults.get(k), dict) and isinstance(v, dict) else v
         for k, v in saved.items()},
  }


def config_from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a checkpoint was trained with: today's defaults overridden by every saved field, so a
  checkpoint written before a field existed reads with that field's default."""
  return ml_collections.ConfigDict(_merged(config_lib.default_config().to_dict(), _tuples(saved)))


class Checkpointer:
  def __init__(self, workdir: str, checkpoint: ml_collections.ConfigDict):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.data_directory = os.path.join(os.path.abspath(workdir), "data_state")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=checkpoint.keep,
        keep_period=checkpoint.keep_period or None,
        enable_async_checkpointing=checkpoint.async_save,
        create=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def checked_step(self, step: int | None, workdir_flag: str = "--workdir") -> int:
    """`step` (default: the latest), refused in one sentence when it is not a complete checkpoint."""
    steps = self.manager.all_steps()
    if not steps:
      raise ConfigError(f"{workdir_flag}={os.path.dirname(self.directory)!r} has no complete checkpoint; "
                        "train a model there first.")
    if step is None:
      return max(steps)
    if step not in steps:
      raise ConfigError(f"--step={step} is not a checkpoint in {self.directory}; saved steps: {sorted(steps)}.")
    return step

  def saved_config(self, step: int) -> ml_collections.ConfigDict:
    """The config saved with `step` (see `config_from_saved`)."""
    return config_from_saved(self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])

  def save(self, step: int, state, config: ml_collections.ConfigDict, data_iterator) -> None:
    data_iterator.save(os.path.join(self.data_directory, str(step)))
    self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config.to_dict())),
        force=True,
    )
    self._remove_orphan_data_states()

  def restore_state(self, step: int, abstract_state):
    """The state at `step`, laid out as `abstract_state`'s shardings: restoring onto any mesh reshards."""
    return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]

  def restore_params(self, step: int, abstract_params):
    """Only the parameters at `step`, laid out as `abstract_params`: a start whose optimizer state may have
    another structure (tools/sparsify.py with other freeze settings, an HF import). Read through a separate
    manager that deletes nothing and keeps this one's save handlers as they are."""
    reader = ocp.CheckpointManager(self.directory)
    try:
      target = {"params": abstract_params}
      restore_args = ocp.checkpoint_utils.construct_restore_args(target)
      args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True))
      return reader.restore(step, args=args)["state"]["params"]
    finally:
      reader.close()

  def restore(self, step: int, abstract_state, data_iterator):
    """The state at `step` and the data iterator's position."""
    data_iterator.restore(os.path.join(self.data_directory, str(step)))
    return self.restore_state(step, abstract_state)

  def check_compatible(self, step: int, config: ml_collections.ConfigDict) -> None:
    """Refuses to resume a workdir whose checkpoint holds a different model, naming the field.

    Compute-only fields (dtype, remat, kernels, FFF implementation) may change between runs.
    """
    saved, wanted = self.saved_config(step).model.to_dict(), config.model.to_dict()
    for prefix, old, new in (("config.model", saved, wanted), ("config.model.ffn", saved["ffn"], wanted["ffn"])):
      for key in sorted(set(old) | set(new)):
        if key not in COMPUTE_ONLY + ("ffn",) and old.get(key) != new.get(key):  # ffn: compared on its own
          raise ConfigError(
              f"{prefix}.{key}={json.dumps(new.get(key))} but the checkpoint in {self.directory} was trained with "
              f"{json.dumps(old.get(key))}; use a new --workdir, or set the field back to resume."
          )

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def _remove_orphan_data_states(self) -> None:
    if jax.process_index() != 0 or not os.path.isdir(self.data_directory):
      return
    kept = set(self.manager.all_steps())
    for name in os.listdir(self.data_directory):
      if name.isdigit() and int(name) not in kept and int(name) < max(kept, default=0):
        shutil.rmtree(os.path.join(self.data_directory, name), ignore_errors=True)


def open_read_only(workdir: str, workdir_flag: str = "--workdir") -> Checkpointer:
  """A Checkpointer for reading a trained run (evaluation, export, analysis): it never deletes a step."""
  if not os.path.isdir(os.path.join(os.path.abspath(workdir), "checkpoints")):
    raise ConfigError(f"{workdir_flag}={workdir!r} holds no checkpoints/ directory; give the workdir of a training run.")
  return Checkpointer(workdir, ml_collections.ConfigDict(dict(keep=None, keep_period=0, async_save=False)))
