"""What a checkpoint step holds and how it is read: its items (state, config, data position) and their orbax
handlers, the records a resume may start empty, and the one-line reasons of a failed read (CheckpointError).

More: docs/modules.md.
"""

import json
import re

import jax
import orbax.checkpoint as ocp

from sparsetx.config import ConfigError

RECORDS = {"health": "bad-step record", "usage": "usage counts"}  # state fields a resume may start empty
ITEMS = ("state", "config")  # in every step; `data` in every step a run saved (all but step-0 starts)
SUPERSEDED = "superseded"  # <workdir>/superseded/<time>/: the steps after a restore_step, set aside
# Status codes of tensorstore / TensorFlow read failures (a damaged file), as opposed to a structure mismatch.
READ_FAILURE = re.compile(r"\b(NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|PERMISSION_DENIED|UNAVAILABLE)\b")


def item_handlers(state_handler=None) -> dict:
  """The handler of each item, given to the manager up front: a manager that learns them only from the first
  save or restore warns, for every item it reads metadata of before that, that the item 'was found in the
  checkpoint, but could not be restored'."""
  return {
    "state": state_handler or ocp.StandardCheckpointHandler(),
    "config": ocp.JsonCheckpointHandler(),
    "data": ocp.JsonCheckpointHandler(),
  }


class CheckpointError(ConfigError):
  """A saved step cannot be read; the message names the step, what is wrong and how to go on."""


def reason(error: BaseException) -> str:
  """One short line for a failed read."""
  text = str(error).strip().split(". See full TensorStore details")[0]
  text = text.splitlines()[0] if text else type(error).__name__
  return text if len(text) <= 240 else text[:240] + "..."


def read_failure(error: BaseException) -> str | None:
  """The reason when `error` (or one it was raised from) is a failed read of a file; None for anything else."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    text = str(error)
    if (
      isinstance(error, (OSError, json.JSONDecodeError))
      or READ_FAILURE.search(text)
      or "Encountered error while reading" in text
    ):
      return reason(error)
    error = error.__cause__ or error.__context__
  return None


def record_fits(saved, abstract) -> bool:
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
