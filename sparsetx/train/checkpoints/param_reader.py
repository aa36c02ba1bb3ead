"""A checkpoint's parameters, one array at a time on the host (numpy), never the optimizer state.

Export holds one shard's arrays at a time, not the model: each read is an orbax partial restore of the arrays it
names, as numpy, so no device memory is used and peak host memory does not grow with the model. Shapes come from
the checkpoint's metadata before anything is read.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from sparsetx import config as config_lib
from sparsetx.data import check_training_files
from sparsetx.train.checkpoints import checkpointing

Path = tuple[str, ...]


class ParamReader:
  """The saved config and the parameter arrays of `step` (default: the latest) of a training workdir."""

  def __init__(self, workdir: str, step: int | None = None, workdir_flag: str = "--workdir", step_flag="--step"):
    self._checkpointer = checkpointing.open_read_only(workdir, workdir_flag, step_flag)
    try:
      self.step = self._checkpointer.checked_step(step, workdir_flag)
      self.config = self._checkpointer.saved_config(self.step)
      check_training_files(config_lib.validate(self.config))
      self._directory = self._checkpointer.directory / str(self.step) / "state"
      with self._checkpointer.reading(self.step):
        metadata = ocp.PyTreeCheckpointHandler().metadata(self._directory).tree["params"]
    except BaseException:
      self._checkpointer.close()
      raise
    flat = traverse_util.flatten_dict(dict(metadata))
    self.shapes = {path: tuple(leaf.shape) for path, leaf in flat.items()}
    self._dtypes = {path: np.dtype(leaf.dtype) for path, leaf in flat.items()}
    self._reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())

  def read(self, wanted: list[Path]) -> dict[Path, np.ndarray]:
    """The arrays at `wanted` (as saved: shapes and dtypes), read from storage now in one restore (orbax reads
    them in parallel)."""
    item = {
      "params": traverse_util.unflatten_dict({p: jax.ShapeDtypeStruct(self.shapes[p], self._dtypes[p]) for p in wanted})
    }
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), item)
    with self._checkpointer.reading(self.step):
      restored = self._reader.restore(
        self._directory, args=ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)
      )
    flat = traverse_util.flatten_dict(restored["params"])
    return {path: flat[path] for path in wanted}

  def close(self) -> None:
    self._reader.close()
    self._checkpointer.close()

  def __enter__(self) -> "ParamReader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
