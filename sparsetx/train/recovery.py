"""What the host does about bad steps (the device skips them: bad_steps.py): one console line per skipped step, the
decision to stop or to roll back, and the workdir's record of the data windows stepped over.

More: docs/modules.md, sparsetx/train/recovery.py.
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
  """Raised by `verdict` to the loop: restore the newest checkpoint before `first_bad` and step over the data."""

  def __init__(self, step: int, first_bad: int, reason: str):
    super().__init__(f"step {step}: {reason}")
    self.step, self.first_bad, self.reason = step, first_bad, reason


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
  """Reads one step's health values (host floats: loss, grad_norm, param_norm, skipped, bad_in_row, the limits):
  prints the line of a skipped step; raises NonFiniteLossError to stop, or RollBack."""
  mode = train.get("bad_steps", "stop")
  norms = ("loss", "grad_norm", "param_norm") if mode == "stop" else ("param_norm",)  # else the device skipped
  if not all(math.isfinite(values[k]) for k in norms):
    reason = ", ".join(f"{k}={values[k]}" for k in ("loss", "grad_norm", "param_norm"))
    if mode == "rollback":
      raise RollBack(step, step, f"non-finite parameters ({reason})")
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
  if mode == "rollback" and in_row >= train.max_bad_in_row:
    raise RollBack(step, step - in_row + 1, f"{in_row} steps skipped in a row, the last for {reason}")


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
