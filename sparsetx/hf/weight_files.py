"""An HF directory's weights as a lazy mapping: each tensor is read by name when asked for, local or gs://.

A read opens the tensor's file with safetensors' safe_open and closes it after, so no file stays mapped and an
import holds the parts it is making, never a whole shard or the model. The names (and the file of each) come from
the index, or from the one file's header. A gs:// directory is read through a local copy: its small files
(config.json, tokenizer files) at once, each weights file when a tensor in it is first asked for, removed once
every tensor in it has been read. The index's file names are checked before any other file is read or copied: each must
be a plain name in the directory, so no index reads (or, from gs://, writes and removes) a file outside it.
"""

import collections
import functools
import json
import os
import tempfile

import numpy as np
import safetensors
from etils import epath

from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.hf.shards import WEIGHTS, WEIGHTS_INDEX

_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def is_plain_file_name(name) -> bool:
  """Whether `name` (an index's weight_map value) names a file in the directory itself: a string with no path
  separator of any system, not empty, '.' or '..' (an absolute path has a separator)."""
  return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


class WeightFiles(collections.abc.Mapping):
  """{tensor name: numpy array in its saved dtype} of `hf_dir`, read when asked for; use as a context manager."""

  def __init__(self, hf_dir: str):
    self.hf_dir = hf_dir
    self._source = paths.resolve(hf_dir)
    self._staging = None
    self._unread = {}  # file -> its tensors not read yet (a downloaded copy is removed once none is left)
    self._weight_map = None  # the index's, checked on entry

  def __enter__(self):
    if paths.is_remote(self.hf_dir):
      self._staging = tempfile.TemporaryDirectory(prefix="sparsetx-hf-")
      self.local_dir = self._staging.name
    else:
      self.local_dir = self.hf_dir
    try:
      self._stage()
    except BaseException:
      self.__exit__(None, None, None)
      raise
    return self

  def _stage(self) -> None:
    """Reads and checks the index (if any), then copies a gs:// directory's small files to the local staging."""
    listed = []
    if self._staging is not None:
      try:
        listed = list(self._source.iterdir())
      except paths.storage_errors() as error:
        raise ConfigError(
          f"{self.hf_dir!r} cannot be read ({paths.cause(error)}); check the bucket's name and this account's "
          "read permission there."
        ) from None
    self._weight_map = self._read_index()
    for path in listed:
      if not path.name.endswith(".safetensors") and path.is_file():
        path.copy(epath.Path(self.local_dir) / path.name)

  def _read_index(self) -> dict[str, str] | None:
    """The index's weight_map ({tensor name: file}), None without an index; refused in one sentence unless every
    file is a plain name in the directory (the names are joined to it as given)."""
    index_path = self._source / WEIGHTS_INDEX
    shown = os.path.join(self.hf_dir, WEIGHTS_INDEX)
    try:
      if not index_path.is_file():
        return None
      index = json.loads(index_path.read_text())
    except paths.storage_errors() as error:
      raise ConfigError(f"{shown!r} cannot be read ({paths.cause(error)}); check that it is there.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
      raise ConfigError(f"{shown!r} is not valid JSON ({error}); export the model again.") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
      raise ConfigError(
        f"{shown!r} holds no weight_map object (tensor name: file name); export the model again or fix the index."
      )
    for name, file in weight_map.items():
      if not is_plain_file_name(file):
        raise ConfigError(
          f"{shown!r} maps {name!r} to {file!r}, which is not a plain file name in that directory; every weight_map "
          "value must name a file beside the index (e.g. 'model-00001-of-00002.safetensors'): fix the index or "
          "export the model again."
        )
    return weight_map

  def __exit__(self, *exc) -> None:
    if self._staging is not None:
      self._staging.cleanup()
      self._staging = None

  @functools.cached_property
  def _file_of(self) -> dict[str, str]:
    """{tensor name: its file}, from the index (checked on entry) or the one file's header (read when first needed,
    so a directory's config.json is judged before its weights)."""
    if self._weight_map is not None:
      file_of = dict(self._weight_map)
      for file in sorted(set(file_of.values())):
        if not (self._source / file).is_file():
          raise ConfigError(
            f"{WEIGHTS_INDEX} in {self.hf_dir!r} names {file!r}, which is missing; the directory is incomplete."
          )
      return file_of
    if (self._source / WEIGHTS).is_file():
      return dict.fromkeys(self._opened(WEIGHTS, lambda f: list(f.keys())), WEIGHTS)
    pickled = [name for name in _PICKLED if (self._source / name).exists()]
    hint = (
      f"it holds {pickled[0]} (pickle, which sparsetx never loads); re-save it with "
      "save_pretrained(dir, safe_serialization=True)"
      if pickled
      else "export the model again"
    )
    raise ConfigError(f"{self.hf_dir!r} has no {WEIGHTS} or {WEIGHTS_INDEX}; {hint}.")

  def _local(self, file: str) -> str:
    path = os.path.join(self.local_dir, file)
    if self._staging is not None and not os.path.exists(path):
      try:
        (self._source / file).copy(epath.Path(path))
      except paths.storage_errors() as error:
        raise ConfigError(
          f"{self.hf_dir}/{file} cannot be read ({paths.cause(error)}); check that it is there."
        ) from None
    return path

  def _opened(self, file: str, read):
    path = self._local(file)
    try:
      with safetensors.safe_open(path, framework="numpy") as f:
        return read(f)
    except Exception as error:  # safetensors raises its own error types for a corrupt header or a missing name
      raise ConfigError(
        f"{os.path.join(self.hf_dir, file)!r} is not a readable safetensors file ({error}); export the model again."
      ) from None

  def __getitem__(self, name: str) -> np.ndarray:
    file = self._file_of[name]
    array = self._opened(file, lambda f: f.get_tensor(name))
    unread = self._unread.setdefault(file, {n for n, f in self._file_of.items() if f == file})
    unread.discard(name)
    if not unread and self._staging is not None:  # a downloaded copy every tensor of which was read
      os.remove(os.path.join(self.local_dir, file))
    return array

  def __contains__(self, name) -> bool:
    return name in self._file_of

  def __iter__(self):
    return iter(self._file_of)

  def __len__(self) -> int:
    return len(self._file_of)
