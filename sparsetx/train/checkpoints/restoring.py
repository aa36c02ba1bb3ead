"""Restores of a saved step: the whole train state onto any mesh (records saved with other shapes start empty), or
only the parameters (a start written by sparsify or an import).

More: docs/modules.md.
"""

import jax
import orbax.checkpoint as ocp
from absl import logging

from sparsetx.train.checkpoints.items import RECORDS, CheckpointError, item_handlers, record_fits


class Restoring:
  """The Checkpointer's restores (it holds `directory`, `manager` and the `reading` guard of Checks)."""

  def restore_state(self, step: int, abstract_state):
    """The state at `step`, laid out as `abstract_state`'s shardings: restoring onto any mesh reshards.

    A record the step was saved without, or with other shapes (the bad-step record of another
    config.train.spike_window; the usage counts of another model, or a sparsetx before they existed), starts
    empty; everything else is restored, with one warning naming what starts empty."""
    with self.reading(step):
      saved = self._saved_tree(step)
      if "opt_state" not in saved:
        raise CheckpointError(
          f"checkpoint step {step} in {self.directory} holds parameters only (a start written by an import), no "
          "train state to restore; the trainer starts it with a fresh optimizer state (restore_params)."
        )
      misfits = [name for name in RECORDS if not record_fits(saved.get(name), getattr(abstract_state, name))]
      if not misfits:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        return self.manager.restore(step, args=args)["state"]
      logging.warning(
        "Checkpoint step %d has no %s of this run's shapes (saved by an older sparsetx, or with another "
        "config.train.spike_window): %s empty.",
        step,
        " or ".join(RECORDS[name] for name in misfits),
        "it starts" if len(misfits) == 1 else "they start",
      )
      kept = [name for name in ("step", "params", "opt_state", *RECORDS) if name not in misfits]
      restored = self._restore_part(step, {name: getattr(abstract_state, name) for name in kept})
    empty = {
      name: jax.jit(
        lambda tree=getattr(abstract_state, name): jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), tree),
        out_shardings=jax.tree.map(lambda a: a.sharding, getattr(abstract_state, name)),
      )()
      for name in misfits
    }
    return abstract_state.replace(**restored, **empty)

  def _saved_tree(self, step: int) -> dict:
    """The metadata tree of the state saved at `step` (arrays' shapes and dtypes by field)."""
    handler = ocp.StandardCheckpointHandler()
    try:
      return dict(handler.metadata(self.directory / str(step) / "state").tree)
    finally:
      handler.close()

  def restore_params(self, step: int, abstract_params):
    """Only the parameters at `step`, laid out as `abstract_params`: a start whose optimizer state may have
    another structure (sparsetx/tools/sparsify.py with other freeze settings, an HF import). Read through a separate
    manager that deletes nothing and keeps this one's save handlers as they are."""
    with self.reading(step):
      return self._restore_part(step, {"params": abstract_params})["params"]

  def _restore_part(self, step: int, target: dict) -> dict:
    """The items of the state at `step` that `target` (abstract arrays by field name) names, the rest left out."""
    reader = ocp.CheckpointManager(self.directory, item_handlers=item_handlers(ocp.PyTreeCheckpointHandler()))
    try:
      restore_args = ocp.checkpoint_utils.construct_restore_args(target)
      args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True))
      return reader.restore(step, args=args)["state"]
    finally:
      reader.close()
