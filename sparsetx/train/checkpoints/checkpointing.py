"""Orbax checkpoints of the train state, the config and the data stream's position, three items of one step.

Each step directory is written by an async `CheckpointManager` and becomes visible only once
complete (orbax's atomic finalize), so a run killed mid-save resumes from the previous one, and every complete
step has its data position (`data`: the stream's step and fingerprint, see sparsetx/data/global_stream.py).
A step-0 start (sparsify, HF import) has none: its stream starts at the beginning.

More: docs/modules.md, sparsetx/train/checkpoints/checkpointing.py.
"""

import contextlib
import json
import logging as logging_std
import os
import re
import time

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.data import check_training_files, global_stream
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import held_errors

COMPUTE_ONLY = (
  "dtype",
  "remat",
  "attention",
  "max_len",
  "kernel",
  "implementation",
  "aux_loss",
  "router_z_loss",
  "logits_dot_in_fp32",
  "scan_layers",
)  # may change on resume (MoE balancing weights: the loss, not the parameters)
_RECORDS = {"health": "bad-step record", "usage": "usage counts"}  # state fields a resume may start empty
ITEMS = ("state", "config")  # in every step; `data` in every step a run saved (all but step-0 starts)
SUPERSEDED = "superseded"  # <workdir>/superseded/<time>/: the steps after a restore_step, set aside
# Status codes of tensorstore / TensorFlow read failures (a damaged file), as opposed to a structure mismatch.
_ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__))  # the records _HeldWarnings may hold
_READ_FAILURE = re.compile(r"\b(NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|PERMISSION_DENIED|UNAVAILABLE)\b")


def _item_handlers(state_handler=None) -> dict:
  """The handler of each item, given to the manager up front: a manager that learns them only from the first
  save or restore warns, for every item it reads metadata of before that, that the item 'was found in the
  checkpoint, but could not be restored'."""
  return {
    "state": state_handler or ocp.StandardCheckpointHandler(),
    "config": ocp.JsonCheckpointHandler(),
    "data": ocp.JsonCheckpointHandler(),
  }


class _HeldWarnings(logging_std.Filter):
  """Keeps back orbax's WARNING records (orbax logs through absl) logged while it is installed; every other record,
  an ERROR or another library's warning, passes at once."""

  def __init__(self):
    super().__init__()
    self.records = []

  def filter(self, record):
    if record.levelno != logging_std.WARNING or _ORBAX_DIR not in os.path.abspath(record.pathname):
      return True
    self.records.append(record)
    return False

  def release(self) -> None:
    for record in self.records:
      logging.get_absl_logger().handle(record)
    self.records = []


@contextlib.contextmanager
def _warnings_held_back():
  """Orbax's warnings while a step is checked ('Metadata file does not exist', 'Item "state" was found in the
  checkpoint, but could not be restored') are dropped when the check fails: its one line says what is wrong.
  The caller releases them when the check passes."""
  held = _HeldWarnings()
  logging.get_absl_logger().addFilter(held)
  try:
    yield held
  finally:
    logging.get_absl_logger().removeFilter(held)


class CheckpointError(ConfigError):
  """A saved step cannot be read; the message names the step, what is wrong and how to go on."""


def _reason(error: BaseException) -> str:
  """One short line for a failed read."""
  text = str(error).strip().split(". See full TensorStore details")[0]
  text = text.splitlines()[0] if text else type(error).__name__
  return text if len(text) <= 240 else text[:240] + "..."


def _read_failure(error: BaseException) -> str | None:
  """The reason when `error` (or one it was raised from) is a failed read of a file; None for anything else."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    text = str(error)
    if (
      isinstance(error, (OSError, json.JSONDecodeError))
      or _READ_FAILURE.search(text)
      or "Encountered error while reading" in text
    ):
      return _reason(error)
    error = error.__cause__ or error.__context__
  return None


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
    **{
      k: _merged(defaults[k], v) if isinstance(defaults.get(k), dict) and isinstance(v, dict) else v
      for k, v in saved.items()
    },
  }


def config_from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a checkpoint was trained with: today's defaults overridden by every saved field, so a
  checkpoint written before a field existed reads with that field's default, and one written with the retired
  kernel knobs (implementation=pallas, gpu_kernel) reads under the one knob that replaced them (attention=pallas,
  retired too, as auto)."""
  saved = _tuples(saved)
  if saved.get("model", {}).get("attention") == "pallas":  # retired: auto takes cuDNN's fused kernel on a GPU
    saved = saved | {"model": saved["model"] | {"attention": "auto"}}
  kernel = saved.get("model", {}).get("ffn", {}).get("kernel")
  if isinstance(kernel, dict) and ("gpu_kernel" in kernel or kernel.get("implementation") == "pallas"):
    implementation = config_lib.implementation_for_retired(
      kernel.get("implementation", "auto"), kernel.get("gpu_kernel")
    )
    kernel = {k: v for k, v in kernel.items() if k != "gpu_kernel"} | {"implementation": implementation}
    saved = saved | {"model": saved["model"] | {"ffn": saved["model"]["ffn"] | {"kernel": kernel}}}
  return ml_collections.ConfigDict(_merged(config_lib.default_config().to_dict(), saved))


def _model_fields(model: dict, prefix: str = "") -> dict:
  """The model's fields that fix its parameters, flattened to dotted names in schema order (compute-only
  fields left out)."""
  fields = {}
  for key, value in model.items():
    if key in COMPUTE_ONLY:
      continue
    if isinstance(value, dict):
      fields.update(_model_fields(value, f"{prefix}{key}."))
    else:
      fields[f"{prefix}{key}"] = value
  return fields


def _basic_rank(key: str) -> int:
  """Most basic first: the layer types, then the network's own fields, then each feed-forward layer's sizes."""
  if key.endswith("type") and "." in key:
    return 0
  return 1 if "." not in key else 2


def _first_index(key: str, *orders: dict) -> int:
  for order in orders:
    if key in order:
      return list(order).index(key)
  return 0


def _record_fits(saved, abstract) -> bool:
  """Whether a saved record (its metadata tree, None when the step has none) has the shapes of `abstract`."""
  if saved is None:
    return not jax.tree.leaves(abstract)  # a model without sparse layers keeps no usage counts
  shapes = lambda tree: {  # noqa: E731
    jax.tree_util.keystr(path): tuple(getattr(leaf, "shape", ()))
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }
  wanted = shapes(abstract.__dict__ if hasattr(abstract, "__dataclass_fields__") else abstract)
  found = shapes(dict(saved) if isinstance(saved, dict) else saved)
  return wanted == found


class Checkpointer:
  """`step_flag` is the flag that picks another saved step, named when a step cannot be read."""

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
    with _warnings_held_back() as self._held:  # about a damaged step, if any: released once it is verified
      self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_item_handlers())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

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
    with _warnings_held_back() as held:
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
      raise self.damaged(step, f"its directory is unreadable ({_reason(error)})") from None
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
      raise self.damaged(step, f"the metadata of its arrays is unreadable ({_reason(error)})") from None
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
      raise self.damaged(step, f"its data state is unreadable ({_reason(error)})") from None
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

  def saved_config(self, step: int) -> ml_collections.ConfigDict:
    """The config saved with `step` (see `config_from_saved`)."""
    try:
      saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except Exception as error:  # noqa: BLE001  (a missing, truncated or garbled config/metadata)
      raise self.damaged(step, f"its saved config is unreadable ({_reason(error)})") from None
    if not isinstance(saved, dict):
      raise self.damaged(step, f"its saved config is not a JSON object ({type(saved).__name__})")
    return config_from_saved(saved)

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
      misfits = [name for name in _RECORDS if not _record_fits(saved.get(name), getattr(abstract_state, name))]
      if not misfits:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        return self.manager.restore(step, args=args)["state"]
      logging.warning(
        "Checkpoint step %d has no %s of this run's shapes (saved by an older sparsetx, or with another "
        "config.train.spike_window): %s empty.",
        step,
        " or ".join(_RECORDS[name] for name in misfits),
        "it starts" if len(misfits) == 1 else "they start",
      )
      kept = [name for name in ("step", "params", "opt_state", *_RECORDS) if name not in misfits]
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
      except Exception as error:  # noqa: BLE001  (classified by _read_failure)
        reason = _read_failure(error)
        if reason is None:
          raise
        raise self.damaged(step, f"reading it failed ({reason})") from None

  def restore_params(self, step: int, abstract_params):
    """Only the parameters at `step`, laid out as `abstract_params`: a start whose optimizer state may have
    another structure (sparsetx/tools/sparsify.py with other freeze settings, an HF import). Read through a separate
    manager that deletes nothing and keeps this one's save handlers as they are."""
    with self.reading(step):
      return self._restore_part(step, {"params": abstract_params})["params"]

  def _restore_part(self, step: int, target: dict) -> dict:
    """The items of the state at `step` that `target` (abstract arrays by field name) names, the rest left out."""
    reader = ocp.CheckpointManager(self.directory, item_handlers=_item_handlers(ocp.PyTreeCheckpointHandler()))
    try:
      restore_args = ocp.checkpoint_utils.construct_restore_args(target)
      args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True))
      return reader.restore(step, args=args)["state"]
    finally:
      reader.close()

  def check_compatible(self, step: int, config: ml_collections.ConfigDict) -> None:
    """Refuses to resume a workdir whose checkpoint holds a different model, naming the most basic field that
    differs (see `_model_fields`: `ffn.type` before `ffn.d_ffw`).

    Compute-only fields (dtype, remat, kernels, FFF implementation) may change between runs.
    """
    saved, wanted = _model_fields(self.saved_config(step).model.to_dict()), _model_fields(config.model.to_dict())
    for key in sorted(set(saved) | set(wanted), key=lambda k: (_basic_rank(k), _first_index(k, wanted, saved))):
      if saved.get(key) != wanted.get(key):
        raise ConfigError(
          f"config.model.{key}={json.dumps(wanted.get(key))} but the checkpoint in {self.directory} was trained with "
          f"{json.dumps(saved.get(key))}; use a new --workdir, or set the field back to resume."
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
