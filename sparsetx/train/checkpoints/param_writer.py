"""A step-0 checkpoint written from parameters given in parts (an HF import), never the whole model at once.

Parts are moved into jax arrays on the host and gathered into groups of half of `max_bytes` (or one larger part),
each one orbax partial save (orbax.checkpoint.experimental.v1.partial) into a pending pytree, which the finalize
merges into the step's `state` item: at most about half the cap plus two parts are held. Parameters only: every
reader of a step-0 start reads its params, and the trainer builds the optimizer state there. The config item is the
run's own checkpoint manager's. More: docs/modules.md.
"""

import jax
import numpy as np
from flax import traverse_util
from orbax.checkpoint.experimental import v1 as ocp_v1
from orbax.checkpoint.experimental.v1 import partial

from sparsetx import paths
from sparsetx.train.checkpoints import checkpointing

PENDING = "params-pending"  # under the workdir while the parts are written (no leading dot: orbax globs it)


def write_start(workdir: str, config, parts, max_bytes: int) -> dict:
  """Writes step 0 of the new local `workdir` from `parts`, (flax path, array or subtree of arrays) pairs; returns
  its summary: the parameters, their bytes, and the most bytes of one group."""
  pending = paths.resolve(workdir) / PENDING
  cpu = jax.devices("cpu")[0]  # host memory, also beside an accelerator
  group, held, largest, count, total = {}, 0, 0, 0, 0
  with (
    paths.writing(f"writing the step-0 checkpoint in {workdir}", f"nothing was left there; {paths.FREE_SPACE}"),
    _uncompressed(),
  ):
    for path, value in parts:
      group[path] = jax.device_put(value, cpu)  # orbax writes a jax array's host buffer as it is, numpy via copies
      del value
      leaves = jax.tree.leaves(group[path])
      nbytes = sum(leaf.nbytes for leaf in leaves)
      held, total, count = held + nbytes, total + nbytes, count + sum(leaf.size for leaf in leaves)
      if 2 * held >= max_bytes:
        largest = max(largest, held)
        _save(pending, group)
        held = 0
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


def _uncompressed() -> ocp_v1.Context:
  """Orbax's context for the saves: tensorstore's compressed write holds a second buffer of the group, and float
  weights shrink little."""
  context = ocp_v1.Context()
  context.array.saving.use_compression = False
  return context


def _save(pending, group: dict) -> None:
  """One partial save of `group` ({flax path: array or subtree}) as the part of the params tree it is; emptied."""
  if group:
    partial.save(pending, {"params": traverse_util.unflatten_dict(group)})
    group.clear()
