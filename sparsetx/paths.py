"""Every file the stack writes or reads under a workdir goes through `etils.epath`.

So a workdir may be a local directory or a URL such as `gs://bucket/run`: epath reaches Cloud
Storage through `tf.io.gfile` (TensorFlow is installed for seqio), orbax writes its arrays there
through tensorstore, and TensorBoard's writer through TensorFlow.
"""

import contextlib
import errno
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator

from etils import epath


def is_remote(path: epath.PathLike) -> bool:
  """Whether `path` is a URL (gs://, s3://, ...) rather than a local path."""
  return "://" in os.fspath(path)


def resolve(path: epath.PathLike) -> epath.Path:
  """`path` as an epath.Path; a local path made absolute (orbax wants absolute paths)."""
  return epath.Path(path) if is_remote(path) else epath.Path(os.path.abspath(os.fspath(path)))


def storage_errors() -> tuple:
  """The exception types a workdir operation raises: OSError, and TensorFlow's gfile errors where epath reached a URL
  through TensorFlow (loaded by then; nothing here imports it for one exception type)."""
  tf = sys.modules.get("tensorflow")
  return (OSError,) if tf is None else (OSError, tf.errors.OpError)


def reason(error: Exception) -> str:
  """The first line of a filesystem error, for a one-sentence message."""
  text = getattr(error, "strerror", None) or str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def check_writable(path: epath.PathLike, probe_name: str) -> epath.Path:
  """Creates the directory `path` (local or a URL) and writes and removes a file `probe_name` in it; raises the
  storage error (`storage_errors()`) when it cannot."""
  path = resolve(path)
  path.mkdir(parents=True, exist_ok=True)
  probe = path / probe_name
  probe.write_text("ok")
  probe.unlink()
  return path


STORAGE_EXIT_CODE = 5  # a program whose write to storage failed (a full disk, a quota, a read-only filesystem)
_STORE_STATUS = re.compile(r"(RESOURCE_EXHAUSTED|PERMISSION_DENIED|UNAVAILABLE|DEADLINE_EXCEEDED): ")  # tensorstore's
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]|\(os error (\d+)\)")  # tensorstore's, Rust's (safetensors)


class StorageError(Exception):
  """A write failed: the message names what was written where, the OS's or store's own words, and what to do."""


def cause(error: BaseException) -> str:
  """The OS's or store's own words for a failed write: the strerror of the OSError behind `error` (tensorstore
  names its errno as [os_error_code='28'], TensorFlow quotes its text), else the first line of the innermost
  error's message."""
  chain = []
  while error is not None and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  for each in chain:
    if isinstance(each, OSError) and each.errno in errno.errorcode:
      return os.strerror(each.errno)
    if code := _OS_ERROR_CODE.search(str(each)):
      return os.strerror(int(code.group(1) or code.group(2)))
    quoted = [os.strerror(code) for code in errno.errorcode if os.strerror(code) in str(each)]
    if quoted:
      return max(quoted, key=len)
  text = reason(chain[-1])
  return text if len(text) <= 240 else text[:240] + "..."


def storage_failure(error: BaseException) -> bool:
  """Whether `error` is a store's refusal of a write: an OSError, TensorFlow's file errors, tensorstore's (a
  ValueError whose status says the store is full, forbidden or unreachable), or any error naming the OS error."""
  if isinstance(error, storage_errors()) or _OS_ERROR_CODE.search(str(error)):
    return True
  return isinstance(error, ValueError) and bool(_STORE_STATUS.match(str(error)))


@contextlib.contextmanager
def writing(what: str, fix: str | Callable[[], str]) -> Iterator[None]:
  """Turns a failed write inside the block into one `StorageError` line: `what` failed (the cause); `fix` (or what
  `fix()` says once it failed: the newest complete checkpoint). Other errors pass unchanged."""
  try:
    yield
  except Exception as error:  # noqa: BLE001  (narrowed by storage_failure; the rest re-raised)
    if not storage_failure(error):
      raise
    words = cause(error)
    raise StorageError(f"{what} failed ({words}); {fitting(fix if isinstance(fix, str) else fix(), words)}") from None


FREE_SPACE = "free space there (or quota) and run the same command again"
_FIXES = {  # the OS's words for a failed write -> what to do instead of freeing space
  os.strerror(errno.EROFS): "make the storage writable again (remount it read-write, or copy the workdir to "
  "writable storage) and run the same command again",
  os.strerror(errno.EACCES): "give this user write permission there and run the same command again",
  os.strerror(errno.EPERM): "give this user write permission there and run the same command again",
}


def fitting(fix: str, words: str) -> str:
  """`fix` with its FREE_SPACE advice replaced by the one for the fault the OS reported (`words`, from `cause`): a
  read-only filesystem or a permission needs no space freed."""
  return fix.replace(FREE_SPACE, _FIXES[words]) if words in _FIXES else fix


def write_text_atomically(path: epath.Path, text: str) -> None:
  """Writes `path` so that a reader (or a crash) sees the old content or the new, never half of it."""
  write_bytes_atomically(path, text.encode())


def write_bytes_atomically(path: epath.Path, data: bytes) -> None:
  # A name of this writer's own: two writers of one file (two runs sharing a table) never rename each other's.
  staged = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
  try:
    staged.write_bytes(data)
    staged.replace(path)
  except BaseException:
    with contextlib.suppress(*storage_errors()):  # a failed write leaves no staged file behind
      staged.unlink(missing_ok=True)
    raise


def copy_tree(source: epath.Path, target: epath.Path) -> None:
  """Copies the files under `source` to `target` (created), keeping the relative layout."""
  for root, _, files in source.walk():
    root = epath.Path(root)
    out = target / os.path.relpath(os.fspath(root), os.fspath(source))
    out.mkdir(parents=True, exist_ok=True)
    for name in files:
      (root / name).copy(out / name, overwrite=True)


@contextlib.contextmanager
def local_staging() -> Iterator[epath.Path]:
  """A local temporary directory for files a library can only write locally (removed afterwards)."""
  with tempfile.TemporaryDirectory(prefix="sparsetx-stage-") as directory:
    yield epath.Path(directory)


def save_figure(fig, path: epath.PathLike, dpi: int = 110) -> None:
  """matplotlib's savefig through epath (a PNG next to a run may live in Cloud Storage too); the image is
  cropped to what is drawn, so a legend placed outside the axes is kept whole."""
  with epath.Path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight")
