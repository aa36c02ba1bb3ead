"""A step-0 checkpoint written from parameters given in parts (an HF import), never the whole model at once.

Parts are gathered into groups of at most `group_bytes` and each group goes through orbax's partial save
(orbax.checkpoint.experimental.v1.partial), which adds it to a pending pytree; the finalize merges them into the
step's `state` item, which the trainer's step-0 start and every reader restore as any step's (parameters only: a
step-0 start builds its fresh optimizer state, so none is written). The config item is saved by the run's own
checkpoint manager. The workdir must be local and new (the import stages it); nothing else writes there meanwhile.
"""

import jax
import numpy as np
from flax import traverse_util
from orbax.checkpoint.experimental.v1 import partial

from sparsetx import paths
from sparsetx.train import checkpointing

PENDING = "params-pending"  # under the workdir while the parts are written (no leading dot: orbax globs it)


def write_start(workdir: str, config, parts, group_bytes: int) -> dict:
  """Writes step 0 of the new local `workdir` from `parts`, (flax path, array or subtree of arrays) pairs; returns
  its summary (the parameter count and bytes, and the most bytes held in one group)."""
  pending = paths.resolve(workdir) / PENDING
  group, held, largest, count, total = {}, 0, 0, 0, 0
  with paths.writing(f"writing the step-0 checkpoint in {workdir}", f"nothing was left there; {paths.FREE_SPACE}"):
    for path, value in parts:
      group[path] = value
      leaves = jax.tree.leaves(value)
      held += sum(leaf.nbytes for leaf in leaves)
      count, total = count + sum(leaf.size for leaf in leaves), total + sum(leaf.nbytes for leaf in leaves)
      if held >= group_bytes:
        largest = max(largest, held)
        _save(pending, group)
        group, held = {}, 0
    largest = max(largest, held)
    _save(pending, group)
    partial.save(pending, {"step": np.zeros((), np.int32)})
    partial.finalize(pending)
    checkpointer = checkpointing.Checkpointer(workdir, config.checkpoint)
    try:
      checkpointer.save(0, None, config, data_state=None)  # the config; the state is the finalized pytree
      checkpointer.wait()
    finally:
      checkpointer.close()
    (pending / "state").rename(checkpointer.directory / "0" / "state")
    pending.rmtree()
  return dict(params=count, bytes=total, largest_group_bytes=largest)


def _save(pending, group: dict) -> None:
  """One partial save of `group` ({flax path: array or subtree}) as the part of the params tree it is."""
  if group:
    partial.save(pending, {"params": traverse_util.unflatten_dict(group)})
    group.clear()
