"""The measured choices `auto` reads on a GPU or TPU: per device kind, JAX version, op and shape class, the
implementations that ran correctly, fastest first, and the reason each other one was dropped.

sparsetx-autotune (train/autotune.py) fills it on the device, as does the trainer before it compiles a step whose
calls it lacks. One JSON file: $SPARSETX_AUTOTUNE_TABLE, else ~/.cache/sparsetx/autotune.json; the trainer keeps a
copy in its workdir and adds what the copy has to a table that lacks it (a restart on a fresh host measures nothing
again). A call it lacks takes the entry at the nearest token count, all else equal. An unreadable table is one
ConfigError, an unwritable one a paths.StorageError; inside `off()` (config.train.autotune=False) it is neither read
nor written. More: docs/modules.md.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import tempfile

import jax
from etils import epath

from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.kernels import op_calls

ENV = "SPARSETX_AUTOTUNE_TABLE"
_cache = {}  # {path: (mtime, entries)}
_off = False  # inside `off()`


@dataclasses.dataclass(frozen=True)
class Entry:
  ranking: tuple  # the names that ran and matched XLA's values, fastest first
  dropped: dict  # {name: why} (raised, faulted, timed out, wrong values)
  ms: dict  # {name: milliseconds} of those that ran

  @property
  def usable(self) -> bool:
    """Whether `auto` may follow it: something ran, and XLA (the reference the others were checked against) did."""
    return bool(self.ranking) and "xla" not in self.dropped


def path() -> pathlib.Path:
  return pathlib.Path(os.environ.get(ENV) or pathlib.Path.home() / ".cache" / "sparsetx" / "autotune.json")


def key(device_kind: str, op: str, shape_class: str) -> str:
  return f"{device_kind} | jax {jax.__version__} | {op} | {shape_class}"


@contextlib.contextmanager
def off():
  """No read, no write inside (config.train.autotune=False): `auto` takes the registry's default order."""
  global _off
  outer, _off = _off, True
  try:
    yield
  finally:
    _off = outer


def used(enabled: bool):
  """The table as read and written (`enabled`, config.train.autotune), else `off()`."""
  return contextlib.nullcontext() if enabled else off()


def _entries() -> dict:
  file = path()
  try:
    mtime = file.stat().st_mtime_ns
  except FileNotFoundError:
    return {}
  except OSError as error:  # a path under a regular file, a directory without permission
    raise ConfigError(f"the autotune table {file} cannot be read ({paths.reason(error)}); {_FIX}") from None
  if _cache.get(file, (None,))[0] != mtime:
    try:
      entries = json.loads(file.read_text())["entries"]
      for entry in entries.values():
        Entry(tuple(entry["ranking"]), dict(entry["dropped"]), dict(entry["ms"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
      raise ConfigError(
        f"the autotune table {file} cannot be read ({type(error).__name__}: {str(error)[:120]}); delete it "
        f"(sparsetx-autotune measures again) or {_FIX}"
      ) from None
    _cache[file] = (mtime, entries)
  return _cache[file][1]


_FIX = f"point ${ENV} at a readable file, or set --config.train.autotune=false to run without it."


def _entry(found: dict) -> Entry:
  return Entry(tuple(found["ranking"]), dict(found["dropped"]), dict(found["ms"]))


def lookup(device_kind: str, op: str, shape_class: str, nearest: bool = False) -> Entry | None:
  """The measured entry for this device kind (under this JAX), op and shape class, or None; with `nearest`, else
  the one measured at the nearest token count with everything else equal."""
  if _off:
    return None
  entries = _entries()
  found = entries.get(key(device_kind, op, shape_class))
  if found is not None or not nearest or op_calls.tokens_of(shape_class) is None:
    return None if found is None else _entry(found)
  tokens, others = op_calls.tokens_of(shape_class), op_calls.but_tokens(shape_class)
  near = []
  for name in entries:
    where, _, measured = name.rpartition(" | ")
    if where == key(device_kind, op, "").removesuffix(" | ") and op_calls.but_tokens(measured) == others:
      near.append((op_calls.token_distance(op_calls.tokens_of(measured), tokens), name))
  return _entry(entries[min(near)[1]]) if near else None


def check_writable() -> None:
  """Raises paths.StorageError now if the table could not be written (before minutes of measuring)."""
  file = path()
  with paths.writing(f"writing the autotune table {file}", _WRITE_FIX):
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp"):
      pass


_WRITE_FIX = f"point ${ENV} at a writable path (or free space there) and run again."


def record(device_kind: str, op: str, shape_class: str, entry: Entry) -> None:
  """Adds (or replaces) one entry; the file is rewritten whole and renamed into place (never left half-written)."""
  if _off:
    raise RuntimeError("the autotune table is off (config.train.autotune=False): nothing may be recorded.")
  entries = dict(_entries())
  entries[key(device_kind, op, shape_class)] = dataclasses.asdict(entry) | {"ranking": list(entry.ranking)}
  _write(entries)


def _write(entries: dict) -> None:
  file = path()
  with paths.writing(f"writing the autotune table {file}", _WRITE_FIX):
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as out:
      json.dump({"entries": entries}, out, indent=1, sort_keys=True)
    os.replace(out.name, file)


WORKDIR_COPY = "autotune.json"  # the trainer's copy of the table in its workdir: a restart elsewhere reads it


def take_from(workdir: epath.Path) -> int:
  """Adds the entries of the workdir's copy that this table lacks (this table's own win); returns how many. A
  restart in a fresh container (an empty ~/.cache) measures nothing that the workdir's run measured before."""
  source = workdir / WORKDIR_COPY
  if _off or not source.exists():
    return 0
  try:
    copied = json.loads(source.read_text())["entries"]
    for entry in copied.values():
      _entry(entry)
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
    raise ConfigError(
      f"the autotune table's copy {source} cannot be read ({type(error).__name__}: {str(error)[:120]}); delete it "
      "(the trainer measures again) or set --config.train.autotune=false."
    ) from None
  entries = _entries()
  added = {name: entry for name, entry in copied.items() if name not in entries}
  if added:
    _write(entries | added)
  return len(added)


def keep_in(workdir: epath.Path) -> None:
  """Writes this table's entries to the workdir's copy (atomically), where there are any."""
  if not _off and (entries := _entries()):
    target = workdir / WORKDIR_COPY
    with paths.writing(f"writing {target}", paths.FREE_SPACE):
      paths.write_text_atomically(target, json.dumps({"entries": entries}, indent=1, sort_keys=True))
