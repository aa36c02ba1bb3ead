"""What the host does about bad steps (the device skips them: bad_steps.py): one console line per skipped step, the
decision to stop or to roll back, and the workdir's record of the data windows stepped over.

More: docs/modules.md, sparsetx/train/run/recovery.py.
"""

import json
import math
import time

import jax
import ml_collections
from absl import logging
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx import paths

RECORD = "skipped_data.json"


class NonFiniteLossError(RuntimeError):
  """The loss, gradient norm or parameter norm became NaN or infinite; the message names the step."""


class BadStepsError(NonFiniteLossError):
  """Rollbacks did not get the run past its bad steps (config.train.max_rollbacks); the message names the windows."""


class RollBack(Exception):  # noqa: N818  (a signal to the loop, not a failure)
  """Raised by `verdict` to the loop: steps `first_bad` to `step` went bad. Under `rollback` the loop restores the
  newest checkpoint at or before `usable` and steps over the data; under `skip` it stops (`skipped_in_row`).

  `usable`: the newest step whose saved parameters are the good ones. A row of skipped steps left the parameters
  and the optimizer state as they were before it, so a checkpoint saved inside the row holds them too (`usable` is
  `step`); non-finite parameters are usable only before the step that made them (`step - 1`)."""

  def __init__(self, step: int, first_bad: int, reason: str, usable: int | None = None):
    super().__init__(f"step {step}: {reason}")
    self.step, self.first_bad, self.reason = step, first_bad, reason
    self.usable = first_bad - 1 if usable is None else usable


def _reason(values: dict, sigmas: float) -> str:
  """Why the device skipped a step, with the value against its threshold."""
  for name in ("loss", "grad_norm"):
    if not math.isfinite(values[name]):
      return f"non-finite {name.replace('_', ' ')} ({values[name]})"
  over = [
    f"{name.replace('_', ' ')} {values[name]:.4g} > {values[f'{name}_limit']:.4g}"
    for name in ("loss", "grad_norm")
    if values[name] > values[f"{name}_limit"]
  ]
  return f"{' and '.join(over)} (the window's mean + {sigmas:g} standard deviations)"


def verdict(step: int, values: dict, train: ml_collections.ConfigDict, saved_step: int) -> None:
  """Reads one step's health values (host floats: loss, grad_norm, param_norm, skipped, bad_in_row, the limits, and
  the device's recent_skips among the last skipped_share_window judged_steps): prints the line of a skipped step;
  raises NonFiniteLossError to stop, or RollBack (a row of max_bad_in_row skipped steps, or non-finite parameters
  under rollback), or BadStepsError when more than max_skipped_share of the last skipped_share_window steps were
  skipped."""
  mode = train.get("bad_steps", "stop")
  norms = ("loss", "grad_norm", "param_norm") if mode == "stop" else ("param_norm",)  # else the device skipped
  if not all(math.isfinite(values[k]) for k in norms):
    reason = ", ".join(f"{k}={values[k]}" for k in ("loss", "grad_norm", "param_norm"))
    if mode == "rollback":
      raise RollBack(step, step, f"non-finite parameters ({reason})", usable=step - 1)
    other = "skip" if math.isfinite(values["param_norm"]) else "rollback"
    raise NonFiniteLossError(
      f"training diverged at step {step} ({reason}); nothing after step {saved_step} was saved. Lower "
      "config.train.learning_rate or raise config.train.warmup_steps (or set config.train.bad_steps="
      f"{other}), then resume."
    )
  if not values["skipped"]:
    return
  reason = _reason(values, float(train.spike_sigmas))
  if jax.process_index() == 0:
    logging.warning("step %d skipped: %s; the update was not applied.", step, reason)
  in_row = int(values["bad_in_row"])
  if in_row >= train.max_bad_in_row:
    raise RollBack(step, step - in_row + 1, f"{in_row} steps skipped in a row, the last for {reason}", usable=step)
  window, share = train.get("skipped_share_window", 200), train.get("max_skipped_share", 0.05)
  recent = int(values.get("recent_skips", 0))
  if values.get("judged_steps", 0) >= window and recent > share * window:
    raise BadStepsError(
      f"{recent} of the last {window} steps were skipped, through step {step} (more than "
      f"config.train.max_skipped_share={share:g} of config.train.skipped_share_window={window}); the run is not "
      f"spiking, it is unstable ({newest(saved_step)}). Lower config.train.learning_rate or "
      "raise config.train.warmup_steps, then resume."
    )


def newest(saved_step: int) -> str:
  return f"the newest checkpoint is step {saved_step}" if saved_step else "no checkpoint was saved yet"


def skipped_in_row(trouble: RollBack, window: tuple[int, int], saved_step: int, max_bad_in_row: int) -> BadStepsError:
  """What ends a `skip` run at max_bad_in_row skipped steps in a row: the steps, the reason and the fixes.
  `window`: the rows' batches, 1-based, in config.data.skip_steps's numbering."""
  return BadStepsError(
    f"steps {trouble.first_bad} to {trouble.step} were all skipped ({trouble.reason}; "
    f"config.train.max_bad_in_row={max_bad_in_row}): the run cannot get past them by "
    f"skipping ({newest(saved_step)}). Lower "
    "config.train.learning_rate or raise config.train.warmup_steps, or step over these batches with "
    f"--config.data.skip_steps={window[0]}:{window[1]} (or config.train.bad_steps=rollback, which does so itself), "
    "then resume."
  )


# The workdir's record.


def _path(workdir: str):
  return paths.resolve(workdir) / RECORD


def recorded(workdir: str) -> list[dict]:
  """The windows rollbacks recorded in `workdir` ([] when none); a damaged record is one ConfigError."""
  path = _path(workdir)
  if not path.exists():
    return []
  try:
    windows = json.loads(path.read_text())["windows"]
    for window in windows:
      config_lib.skip_step_windows(ml_collections.ConfigDict(dict(skip_steps=window["steps"])))
  except (ValueError, KeyError, TypeError) as error:
    raise config_lib.ConfigError(
      f"{path} is not a record of skipped data windows ({error}); repair it (it lists the windows rollbacks "
      "stepped over) or delete it to train on them again."
    ) from None
  return windows


def windows(config: ml_collections.ConfigDict, workdir: str) -> tuple[tuple[int, int], ...]:
  """The windows a run in `workdir` steps over: config.data.skip_steps and the record's, sorted by start."""
  found = list(config_lib.skip_step_windows(config.data))
  for window in recorded(workdir):
    found += config_lib.skip_step_windows(ml_collections.ConfigDict(dict(skip_steps=window["steps"])))
  return tuple(sorted(found))


def check_rollbacks_left(workdir: str, train: ml_collections.ConfigDict, trouble: RollBack) -> None:
  """Raises BadStepsError naming the windows tried when the workdir has used its config.train.max_rollbacks."""
  tried = recorded(workdir)
  if len(tried) >= train.max_rollbacks:
    windows_text = ", ".join(w["steps"] for w in tried) or "none"
    raise BadStepsError(
      f"training went bad again at step {trouble.step} ({trouble.reason}) after {len(tried)} rollbacks "
      f"(config.train.max_rollbacks={train.max_rollbacks}; data windows stepped over: {windows_text}); lower "
      "config.train.learning_rate or raise config.train.warmup_steps, then resume."
    )


def record(workdir: str, start: int, end: int, trouble: RollBack, restored: int) -> None:
  """Adds the window START:END (1-based) to the workdir's record (process 0, atomically), then waits for it."""
  if jax.process_index() == 0:
    entry = dict(
      steps=f"{start}:{end}",
      reason=f"step {trouble.step}: {trouble.reason}",
      restored_step=restored,
      time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    text = json.dumps(dict(windows=[*recorded(workdir), entry]), indent=2) + "\n"
    with paths.writing(f"writing {_path(workdir)}", lambda: paths.FREE_SPACE):
      paths.write_text_atomically(_path(workdir), text)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("recovery_record")
