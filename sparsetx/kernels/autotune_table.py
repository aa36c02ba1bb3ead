"""The measured choices `auto` reads on a GPU or TPU: per device kind, JAX version, kernels' code, op, kernel options
and shape class, the implementations that ran correctly, fastest first, and why each other one was dropped.

sparsetx-autotune (plan/autotune.py) fills it, as does the trainer before a step whose calls it lacks. One JSON file,
local or gs:// (sparsetx.paths): $SPARSETX_AUTOTUNE_TABLE, else ~/.cache/sparsetx/autotune.json; the trainer keeps a
copy in its workdir. A call it lacks takes the entry at the nearest token count, all else equal. `agree()` makes every
process of a run follow process 0's entries. An unreadable table is one ConfigError, an unwritable one a
paths.StorageError; inside `off()` (config.train.autotune=False) it is neither read nor written. More: docs/modules.md.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib

import jax
import numpy as np
from etils import epath

from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.kernels import op_calls
from sparsetx.kernels.options import KernelOptions

ENV = "SPARSETX_AUTOTUNE_TABLE"
_cache = {}  # {path: (what its stat said, entries)}
_off = False  # inside `off()`
_pinned = None  # process 0's entries after `agree()`: what lookup reads on every process of the run
_code_version = None  # code_version(), once per process
# The options the implementations read: all but the choice itself and interpret mode (no config knob).
KNOBS = tuple(field for field in KernelOptions._fields if field not in ("implementation", "interpret"))


@dataclasses.dataclass(frozen=True)
class Entry:
  ranking: tuple  # the names that ran and matched XLA's values, fastest first
  dropped: dict  # {name: why} (raised, faulted, timed out, wrong values)
  ms: dict  # {name: milliseconds} of those that ran

  @property
  def usable(self) -> bool:
    """Whether `auto` may follow it: something ran, and XLA (the reference the others were checked against) did."""
    return bool(self.ranking) and "xla" not in self.dropped


def path() -> epath.Path:
  """The table (gs:// or local, through sparsetx.paths)."""
  return paths.resolve(os.environ.get(ENV) or pathlib.Path.home() / ".cache" / "sparsetx" / "autotune.json")


def code_version() -> str:
  """A hash of the kernels package's sources. The whole package, not one implementation's module: what a kernel
  does also comes from the code it shares (the op's forms, records and tilings, the hot-row cut, the options,
  the device's refusals), and a verdict measured on other code is measured again, never trusted."""
  global _code_version
  if _code_version is None:
    package = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for source in sorted(p for p in package.rglob("*.py") if p.is_file()):  # not an editor's dangling lock link
      digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes() + b"\0")
    _code_version = digest.hexdigest()[:12]
  return _code_version


def knobs(options: KernelOptions | None = None) -> str:
  """The kernel options of a key, `name=value,...` (None: KernelOptions()'s defaults)."""
  options = KernelOptions() if options is None else options
  return ",".join(f"{knob}={getattr(options, knob)}" for knob in KNOBS)


def key(device_kind: str, op: str, shape_class: str, options: KernelOptions | None = None) -> str:
  """Everything a verdict depends on; the shape class last (the nearest-token lookup compares what precedes it)."""
  return f"{device_kind} | jax {jax.__version__} | kernels {code_version()} | {op} | {knobs(options)} | {shape_class}"


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


def is_off() -> bool:
  return _off


def source() -> str:
  """What lookup reads, for a log line."""
  return f"the autotune table {path()}" if _pinned is None else "process 0's autotune table (agreed)"


def _changed_since(file: epath.Path):
  """What says the file changed: locally its mtime in ns and size; a store's stat (None where it has no mtime: the
  caller reads it again)."""
  if not paths.is_remote(file):
    stat = os.stat(file)
    return stat.st_mtime_ns, stat.st_size
  stat = file.stat()
  return (stat.mtime, stat.length) if getattr(stat, "mtime", None) else None


def _entries() -> dict:
  """This process's table as its file holds it."""
  file = path()
  try:
    version = _changed_since(file)
  except FileNotFoundError:
    return {}
  except paths.storage_errors() as error:  # a path under a regular file, no permission, an unreachable store
    raise ConfigError(f"the autotune table {file} cannot be read ({paths.reason(error)}); {_FIX}") from None
  cached = _cache.get(os.fspath(file))
  if version is None or cached is None or cached[0] != version:
    entries = _parsed(file, f"the autotune table {file}", f"delete it (sparsetx-autotune measures again) or {_FIX}")
    _cache[os.fspath(file)] = (version, entries)
    return entries
  return cached[1]


_FIX = f"point ${ENV} at a readable file, or set --config.train.autotune=false to run without it."


def _parsed(file: epath.Path, what: str, fix: str) -> dict:
  try:
    entries = json.loads(file.read_text())["entries"]
    for entry in entries.values():
      _entry(entry)
  except (*paths.storage_errors(), ValueError, KeyError, TypeError, AttributeError) as error:
    raise ConfigError(f"{what} cannot be read ({type(error).__name__}: {str(error)[:120]}); {fix}") from None
  return entries


def _entry(found: dict) -> Entry:
  return Entry(tuple(found["ranking"]), dict(found["dropped"]), dict(found["ms"]))


def lookup(
  device_kind: str, op: str, shape_class: str, options: KernelOptions | None = None, nearest: bool = False
) -> Entry | None:
  """The measured entry for this device kind (under this JAX and kernels' code), op, options and shape class, or
  None; with `nearest`, else the one measured at the nearest token count with everything else equal. After
  `agree()`, process 0's entries."""
  if _off:
    return None
  entries = _entries() if _pinned is None else _pinned
  found = entries.get(key(device_kind, op, shape_class, options))
  if found is not None or not nearest or op_calls.tokens_of(shape_class) is None:
    return None if found is None else _entry(found)
  tokens, others = op_calls.tokens_of(shape_class), op_calls.but_tokens(shape_class)
  near, where = [], key(device_kind, op, "", options).removesuffix(" | ")
  for name in entries:
    prefix, _, measured = name.rpartition(" | ")
    if prefix == where and op_calls.but_tokens(measured) == others:
      near.append((op_calls.token_distance(op_calls.tokens_of(measured), tokens), name))
  return _entry(entries[min(near)[1]]) if near else None


def agree(workdir: epath.Path | None = None) -> int:
  """Makes every process of a multi-process run trace with process 0's entries: process 0 sends its table, every
  process keeps it in memory for lookup (its own file is still what `record` writes). Different hosts' tables
  (node-local caches, a replaced node, a table rewritten between two traces) would give one program different
  kernels in different processes. Called by every process before the step is traced; returns the entry count.
  Process 0 first adds `workdir`'s copy (take_from); a failure there or in its read stops every process alike."""
  global _pinned
  if _off or jax.process_count() == 1:
    return 0
  from jax.experimental import multihost_utils  # noqa: PLC0415 (only a multi-process run needs it)

  sent, failure = b"", None
  if jax.process_index() == 0:
    try:
      if workdir is not None:
        take_from(workdir)
      sent = json.dumps(_entries(), sort_keys=True).encode()
    except Exception as error:  # noqa: BLE001  (the others must not wait for a table that never comes)
      failure = error
  length = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if failure else len(sent))))
  if length < 0:
    if failure is not None:
      raise failure
    raise ConfigError(f"process 0's autotune table cannot be read (its log says why); {_FIX}")
  buffer = np.frombuffer(sent, np.uint8) if jax.process_index() == 0 else np.zeros(length, np.uint8)
  received = multihost_utils.broadcast_one_to_all(buffer) if length else buffer
  _pinned = json.loads(np.asarray(received, np.uint8).tobytes() or b"{}")
  # The same entries give the same choices only under the same key: every process must run the same JAX and kernels.
  mine = int(hashlib.sha256(f"{jax.__version__} {code_version()}".encode()).hexdigest()[:15], 16)
  found = np.asarray(multihost_utils.process_allgather(np.array([mine], np.int64))).reshape(-1)
  if len(set(found.tolist())) > 1:
    others = [i for i, h in enumerate(found.tolist()) if h != found[0]]
    raise ConfigError(
      f"processes {others} run other kernels or another JAX than process 0 (sparsetx/kernels' code {code_version()} "
      f"and jax {jax.__version__} here): one program would mix kernels; install the same sparsetx and JAX on every "
      "host."
    )
  return len(_pinned)


@contextlib.contextmanager
def agreed(workdir: epath.Path | None = None):
  """`agree(workdir)` for the block (yields its entry count), this process's own file again after it."""
  try:
    yield agree(workdir)
  finally:
    unpin()


def unpin() -> None:
  """Lookup reads this process's own file again (undoes `agree()`)."""
  global _pinned
  _pinned = None


def check_writable() -> None:
  """Raises paths.StorageError now if the table could not be written (before minutes of measuring)."""
  file = path()
  with paths.writing(f"writing the autotune table {file}", _WRITE_FIX):
    paths.check_writable(file.parent, f".{file.name}.{os.getpid()}.probe")


_WRITE_FIX = f"point ${ENV} at a writable path (or free space there) and run again."


def record(device_kind: str, op: str, shape_class: str, entry: Entry, options: KernelOptions | None = None) -> None:
  """Adds (or replaces) one entry; the file is rewritten whole and renamed into place (never left half-written)."""
  if _off:
    raise RuntimeError("the autotune table is off (config.train.autotune=False): nothing may be recorded.")
  entries = dict(_entries())
  entries[key(device_kind, op, shape_class, options)] = dataclasses.asdict(entry) | {"ranking": list(entry.ranking)}
  _write(entries)


def _write(entries: dict) -> None:
  file = path()
  with paths.writing(f"writing the autotune table {file}", _WRITE_FIX):
    file.parent.mkdir(parents=True, exist_ok=True)
    paths.write_text_atomically(file, json.dumps({"entries": entries}, indent=1, sort_keys=True))
  _cache.pop(os.fspath(file), None)  # a store whose mtime has whole seconds could look unchanged


WORKDIR_COPY = "autotune.json"  # the trainer's copy of the table in its workdir: a restart elsewhere reads it


def take_from(workdir: epath.Path) -> int:
  """Adds the entries of the workdir's copy that this table lacks (this table's own win); returns how many. A
  restart in a fresh container (an empty ~/.cache) measures nothing that the workdir's run measured before. Keys
  are kept as they are: an entry of other kernels' code or options matches no call, which is measured again."""
  source = workdir / WORKDIR_COPY
  if _off or not source.exists():
    return 0
  copied = _parsed(
    source,
    f"the autotune table's copy {source}",
    "delete it (the trainer measures again) or set --config.train.autotune=false.",
  )
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
