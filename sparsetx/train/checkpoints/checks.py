"""The checks a saved step passes before anything is built (its items, its config, its arrays' metadata, its data
position), the model a resume must match, and a failed read of a step turned into one line (CheckpointError).

More: docs/modules.md.
"""

import contextlib
import json

import ml_collections
import orbax.checkpoint as ocp

from sparsetx.config import ConfigError
from sparsetx.data import global_stream
from sparsetx.train.checkpoints import held_errors
from sparsetx.train.checkpoints.held_errors import warnings_held_back
from sparsetx.train.checkpoints.items import ITEMS, CheckpointError, read_failure, reason
from sparsetx.train.checkpoints.saved_config import basic_rank, config_from_saved, first_index, model_fields


class Checks:
  """The Checkpointer's checks of a saved step (it holds `directory`, `manager`, `step_flag` and `_held`, the
  orbax warnings of its start, released once a step is verified)."""

  def checked_step(self, step: int | None, workdir_flag: str = "--workdir") -> int:
    """`step` (default: the latest), refused in one sentence when it is not a complete, readable checkpoint."""
    steps = self.manager.all_steps()
    if not steps:
      raise ConfigError(
        f"{workdir_flag}={str(self.directory.parent)!r} has no complete checkpoint; train a model there first."
      )
    if step is not None and step not in steps:
      raise ConfigError(
        f"{self.step_flag}={step} is not a checkpoint in {self.directory}; saved steps: {sorted(steps)}."
      )
    step = max(steps) if step is None else step
    self.verify(step)
    return step

  def resume_step(self, restore_step: int | None = None) -> int | None:
    """The step a training run resumes from (`restore_step`, default the newest; None when there is none),
    verified with its data state before anything is built."""
    steps = self.manager.all_steps()
    if restore_step is not None and restore_step not in steps:
      raise CheckpointError(
        f"{self.step_flag}={restore_step} is not a saved step in {self.directory}; saved steps: "
        f"{', '.join(map(str, sorted(steps))) or 'none'}."
      )
    step = restore_step if restore_step is not None else max(steps, default=None)
    if step is not None:
      self.verify(step, data_state=step > 0)  # a step-0 start (sparsify, import) has no data state
    return step

  def verify(self, step: int, data_state: bool = False) -> None:
    """Refuses a step that cannot be read, before anything is built: an item missing (an empty step
    directory included), a config or array metadata that does not parse or whose files are gone, and with
    `data_state` a missing or unreadable `data` item (the stream position). Array contents are read (and their
    failures reported the same way) by the restore itself."""
    with warnings_held_back() as held:
      self._verify(step, data_state)
    for records in (self._held, held):  # the step reads: orbax's warnings were not the prelude of our error
      records.release()

  def _verify(self, step: int, data_state: bool) -> None:
    with self._holding_echoes(step):  # the metadata reads go through tensorstore too
      self._verify_items(step, data_state)

  def _verify_items(self, step: int, data_state: bool) -> None:
    step_dir = self.directory / str(step)
    try:  # the item directories, as orbax finds them: each item's own metadata is read (and named) below
      items = {path.name for path in step_dir.iterdir() if path.is_dir()}
    except Exception as error:  # noqa: BLE001  (any failed listing, local or remote)
      raise self.damaged(step, f"its directory is unreadable ({reason(error)})") from None
    missing = [item for item in ITEMS if item not in items]
    if len(missing) == len(ITEMS):
      raise self.damaged(step, f"its directory {step_dir} holds no checkpoint items")
    if missing:
      raise self.damaged(step, f"its {missing[0]!r} item ({step_dir / missing[0]}) is missing")
    self.saved_config(step)
    handler = ocp.StandardCheckpointHandler()
    try:
      handler.metadata(step_dir / "state")
    except Exception as error:  # noqa: BLE001
      raise self.damaged(step, f"the metadata of its arrays is unreadable ({reason(error)})") from None
    finally:
      handler.close()
    if data_state:
      if "data" not in items:
        raise self.damaged(step, f"its 'data' item ({step_dir / 'data'}), the data stream's position, is missing")
      self.data_state(step)

  def data_state(self, step: int) -> dict:
    """The data stream's position saved with `step` (global_stream.check_state)."""
    try:
      saved = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    except Exception as error:  # noqa: BLE001  (a missing, truncated or garbled item)
      raise self.damaged(step, f"its data state is unreadable ({reason(error)})") from None
    try:
      return global_stream.check_state(saved)
    except ValueError as error:
      raise self.damaged(step, str(error)) from None

  def damaged(self, step: int, problem: str) -> CheckpointError:
    """The one-line error for an unreadable `step`: what is wrong, the other saved steps, the flag to pick one."""
    self._held.records.clear()  # orbax's warnings about the step: its one line says what is wrong
    others = sorted(s for s in self.manager.all_steps() if s != step)
    if others:
      way = (
        f"pick an older complete step with {self.step_flag}=N (saved steps: {', '.join(map(str, others))}); "
        "nothing was deleted."
      )
    else:
      way = "no other step is saved, so start over in a new --workdir; nothing was deleted."
    return CheckpointError(f"checkpoint step {step} in {self.directory} cannot be read: {problem}; {way}")

  def saved_config(self, step: int) -> ml_collections.ConfigDict:
    """The config saved with `step` (see `config_from_saved`)."""
    try:
      saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except Exception as error:  # noqa: BLE001  (a missing, truncated or garbled config/metadata)
      raise self.damaged(step, f"its saved config is unreadable ({reason(error)})") from None
    if not isinstance(saved, dict):
      raise self.damaged(step, f"its saved config is not a JSON object ({type(saved).__name__})")
    return config_from_saved(saved)

  def check_compatible(self, step: int, config: ml_collections.ConfigDict) -> None:
    """Refuses to resume a workdir whose checkpoint holds a different model, naming the most basic field that
    differs (see `model_fields`: `ffn.type` before `ffn.d_ffw`).

    Compute-only fields (dtype, remat, kernels, FFF implementation) may change between runs.
    """
    saved, wanted = model_fields(self.saved_config(step).model.to_dict()), model_fields(config.model.to_dict())
    for key in sorted(set(saved) | set(wanted), key=lambda k: (basic_rank(k), first_index(k, wanted, saved))):
      if saved.get(key) != wanted.get(key):
        raise ConfigError(
          f"config.model.{key}={json.dumps(wanted.get(key))} but the checkpoint in {self.directory} was trained with "
          f"{json.dumps(saved.get(key))}; use a new --workdir, or set the field back to resume."
        )

  def _holding_echoes(self, step: int, reported: type[BaseException] = CheckpointError) -> held_errors.HeldErrors:
    """What a failed read or save of `step` echoes from orbax's other tasks, held while it runs (see held_errors)."""
    return held_errors.HeldErrors(str(self.directory / str(step)), reported=reported)

  @contextlib.contextmanager
  def reading(self, step: int):
    """Turns a failed read of a file of `step` into its `damaged` error; other errors pass unchanged."""
    with self._holding_echoes(step):
      try:
        yield
      except ConfigError:
        raise
      except Exception as error:  # noqa: BLE001  (classified by read_failure)
        reason = read_failure(error)
        if reason is None:
          raise
        raise self.damaged(step, f"reading it failed ({reason})") from None
