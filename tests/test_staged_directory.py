"""Export's staged directory (sparsetx/hf/output.py): a failed write never damages the previous output, and what it
writes has the modes the user's umask gives any new file."""

import os
import pathlib

import numpy as np
import pytest
import safetensors.numpy

from sparsetx.hf import output


def test_a_failed_write_keeps_the_previous_directory_and_leaves_no_staging(tmp_path, monkeypatch):
  """The staged directory: a failure inside the block, or in the final rename, leaves the old output as it was."""
  target = tmp_path / "out"
  target.mkdir()
  (target / "config.json").write_text("old")
  with pytest.raises(RuntimeError, match="write failed"):
    with output.StagedDirectory(str(target)) as staged:
      pathlib.Path(staged.path, "config.json").write_text("new")
      raise RuntimeError("write failed")
  rename = os.rename

  def failing_final_rename(source, destination):  # only the staged directory's rename fails, not the put-back
    if ".partial-" in source and destination == str(target):
      raise OSError("disk gone")
    rename(source, destination)

  monkeypatch.setattr(os, "rename", failing_final_rename)
  with pytest.raises(OSError, match="disk gone"):
    with output.StagedDirectory(str(target)) as staged:
      pathlib.Path(staged.path, "config.json").write_text("new")
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(target) == ["config.json"]
  assert (target / "config.json").read_text() == "old"
  with output.StagedDirectory(str(target)) as staged:
    pathlib.Path(staged.path, "config.json").write_text("new")
  assert sorted(os.listdir(tmp_path)) == ["out"] and (target / "config.json").read_text() == "new"


def test_an_output_has_the_umasks_modes_not_mkdtemps(tmp_path):
  """mkdtemp makes the staging directory 0700 and safetensors writes 0600: a teammate could read neither."""
  target = tmp_path / "out"
  previous = os.umask(0o027)
  try:
    with output.StagedDirectory(str(target)) as staged:
      staged.put(
        lambda d: safetensors.numpy.save_file({"w": np.zeros(3, np.float32)}, os.path.join(d, "w.safetensors"))
      )
  finally:
    os.umask(previous)
  assert oct(target.stat().st_mode & 0o777) == oct(0o750)
  assert oct((target / "w.safetensors").stat().st_mode & 0o777) == oct(0o640)
