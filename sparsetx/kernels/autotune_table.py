"""The measured choices `auto` reads on a GPU or TPU: per device kind, JAX version, op and shape class, the
implementations that ran correctly, fastest first, and the reason each other one was dropped.

sparsetx-autotune (train/autotune.py) fills it on the device; the trainer does the same before it compiles a step
whose shapes it lacks. One JSON file: $SPARSETX_AUTOTUNE_TABLE, else ~/.cache/sparsetx/autotune.json. It records
what ran, and where: a kernel that faulted on one device kind and JAX version is dropped there only.
"""

import dataclasses
import json
import os
import pathlib
import tempfile

import jax

ENV = "SPARSETX_AUTOTUNE_TABLE"
_cache = {}  # {path: (mtime, entries)}


@dataclasses.dataclass(frozen=True)
class Entry:
  ranking: tuple  # the names that ran and matched XLA's values, fastest first
  dropped: dict  # {name: why} (raised, faulted, wrong values, no answer)
  ms: dict  # {name: milliseconds} of those that ran


def path() -> pathlib.Path:
  return pathlib.Path(os.environ.get(ENV) or pathlib.Path.home() / ".cache" / "sparsetx" / "autotune.json")


def key(device_kind: str, op: str, shape_class: str) -> str:
  return f"{device_kind} | jax {jax.__version__} | {op} | {shape_class}"


def _entries() -> dict:
  file = path()
  try:
    mtime = file.stat().st_mtime_ns
  except FileNotFoundError:
    return {}
  if _cache.get(file, (None,))[0] != mtime:
    try:
      entries = json.loads(file.read_text())["entries"]
    except (ValueError, KeyError, TypeError) as error:
      raise ValueError(
        f"the autotune table {file} cannot be read ({error}); delete it (sparsetx-autotune measures again)."
      ) from None
    _cache[file] = (mtime, entries)
  return _cache[file][1]


def lookup(device_kind: str, op: str, shape_class: str) -> Entry | None:
  """The measured entry for this device kind (under this JAX), op and shape class, or None."""
  found = _entries().get(key(device_kind, op, shape_class))
  return None if found is None else Entry(tuple(found["ranking"]), dict(found["dropped"]), dict(found["ms"]))


def record(device_kind: str, op: str, shape_class: str, entry: Entry) -> None:
  """Adds (or replaces) one entry; the file is rewritten whole and renamed into place (never left half-written)."""
  file = path()
  entries = dict(_entries())
  entries[key(device_kind, op, shape_class)] = dataclasses.asdict(entry) | {"ranking": list(entry.ranking)}
  file.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as out:
    json.dump({"entries": entries}, out, indent=1, sort_keys=True)
  os.replace(out.name, file)
