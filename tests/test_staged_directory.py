"""Export's staged directory (sparsetx/hf/export.py): a failed write never damages the previous output."""

import os
import pathlib

import pytest

from sparsetx.hf import export


def test_a_failed_write_keeps_the_previous_directory_and_leaves_no_staging(tmp_path, monkeypatch):
  """The staged directory: a failure inside the block, or in the final rename, leaves the old output as it was."""
  target = tmp_path / "out"
  target.mkdir()
  (target / "config.json").write_text("old")
  with pytest.raises(RuntimeError, match="write failed"):
    with export._StagedDirectory(str(target)) as staged:
      pathlib.Path(staged.path, "config.json").write_text("new")
      raise RuntimeError("write failed")
  rename = os.rename

  def failing_final_rename(source, destination):  # only the staged directory's rename fails, not the put-back
    if ".partial-" in source and destination == str(target):
      raise OSError("disk gone")
    rename(source, destination)

  monkeypatch.setattr(os, "rename", failing_final_rename)
  with pytest.raises(OSError, match="disk gone"):
    with export._StagedDirectory(str(target)) as staged:
      pathlib.Path(staged.path, "config.json").write_text("new")
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(target) == ["config.json"]
  assert (target / "config.json").read_text() == "old"
  with export._StagedDirectory(str(target)) as staged:
    pathlib.Path(staged.path, "config.json").write_text("new")
  assert sorted(os.listdir(tmp_path)) == ["out"] and (target / "config.json").read_text() == "new"
