"""Where an export or import writes: a local directory staged and renamed into place, or a gs:// prefix file by file.

Local: a hidden sibling directory, renamed over the target at the end, so a failure leaves the previous output as
it was and no half-written one. gs:// has no rename of a directory: each file is written to local staging, uploaded
and removed there, in the order the writer gives (the weights' index, or the one weights file, last), so a reader
never finds an index naming a shard not yet there; a failure removes what was uploaded. Both give new files and
directories the permissions the user's umask gives any (a team's shared filesystem, an evaluation job under another
account), not mkdtemp's 0700.
"""

import os
import shutil
import tempfile
from collections.abc import Callable

from etils import epath

from sparsetx import paths
from sparsetx.config import ConfigError


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def check_target(target: str, overwrite: bool, what: str, marker: str) -> None:
  """Refuses a target that holds files unless `overwrite`, and then only one holding `marker`."""
  path = paths.resolve(target)
  if path.exists() and not path.is_dir():
    raise ConfigError(f"{what}={target!r} is a file; give a directory path.")
  if not path.is_dir() or not any(path.iterdir()):
    return
  if not overwrite:
    raise ConfigError(f"{what}={target!r} already holds files; choose a new directory or pass --overwrite.")
  if not (path / marker).exists():
    raise ConfigError(
      f"{what}={target!r} holds files but no {marker}, so it is not an earlier output of this tool; "
      "--overwrite only replaces those. Choose a new directory."
    )


class StagedDirectory:
  """A hidden sibling of `target` to write into; `commit()` puts it in place of `target` in one rename.

  As a context manager it commits when the block ends normally and discards what was written otherwise.
  """

  def __init__(self, target: str):
    self.target = os.path.abspath(target)
    parent = os.path.dirname(self.target)
    os.makedirs(parent, exist_ok=True)
    self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.partial-", dir=parent)
    os.chmod(self.path, 0o777 & ~_umask())

  def put(self, write: Callable[[str], None]) -> None:
    """`write(directory)` writes files into the output (given the umask's modes: safetensors writes 0600)."""
    write(self.path)
    for name in os.listdir(self.path):
      if os.path.isfile(os.path.join(self.path, name)):
        os.chmod(os.path.join(self.path, name), 0o666 & ~_umask())

  def commit(self) -> None:
    old = None
    if os.path.isdir(self.target):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.old-", dir=os.path.dirname(self.target))
      os.rename(self.target, os.path.join(old, "replaced"))
    try:
      os.rename(self.path, self.target)
    except OSError:
      if old:  # put the previous directory back
        os.rename(os.path.join(old, "replaced"), self.target)
        os.rmdir(old)
      raise
    if old:
      shutil.rmtree(old, ignore_errors=True)

  def discard(self) -> None:
    shutil.rmtree(self.path, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, error_type, error, traceback) -> None:
    if error_type is not None:
      self.discard()
      return
    try:
      self.commit()
    except BaseException:
      self.discard()
      raise


class UploadedDirectory(StagedDirectory):
  """A gs:// (or other URL) target written file by file through local staging; see the module's docstring.

  `stale` names files of an earlier output that the new one may not rewrite (its shards): removed once the new
  output is complete. The earlier output's `first_removed` (its index) goes before anything is written."""

  def __init__(self, target: str, first_removed: tuple[str, ...] = (), stale: Callable[[str], bool] = lambda n: False):
    self.target, self._stale, self._uploaded = paths.resolve(target), stale, []
    self.target.mkdir(parents=True, exist_ok=True)
    for name in first_removed:
      if (self.target / name).exists():
        (self.target / name).unlink()
    self._earlier = {path.name for path in self.target.iterdir()}
    self.path = tempfile.mkdtemp(prefix="sparsetx-upload-")

  def put(self, write: Callable[[str], None]) -> None:
    staging = tempfile.mkdtemp(dir=self.path)
    try:
      write(staging)
      for name in sorted(os.listdir(staging)):
        epath.Path(staging, name).copy(self.target / name, overwrite=True)
        self._uploaded.append(name)
    finally:
      shutil.rmtree(staging, ignore_errors=True)

  def commit(self) -> None:
    for name in self._earlier - set(self._uploaded):
      if self._stale(name):
        (self.target / name).unlink()
    shutil.rmtree(self.path, ignore_errors=True)

  def discard(self) -> None:
    for name in self._uploaded:
      try:
        (self.target / name).unlink()
      except Exception:  # noqa: BLE001  (best effort: the store that failed the upload may refuse this too)
        pass
    shutil.rmtree(self.path, ignore_errors=True)


def open_output(target: str, **remote) -> StagedDirectory:
  """The output for `target`: a StagedDirectory for a local path, an UploadedDirectory for a URL."""
  return UploadedDirectory(target, **remote) if paths.is_remote(target) else StagedDirectory(target)
