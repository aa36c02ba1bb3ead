"""A full disk (a real tmpfs, filled) ends a program in one line naming what failed, where, the OS's words and what to
do, with exit code 5 (paths.STORAGE_EXIT_CODE); nothing complete is damaged, and a rerun with room resumes bitwise."""

import errno
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO
from test_checkpoint_damage import micro_config

from sparsetx import paths
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop

TRAIN_FLAGS = [  # micro_config(steps=6) on the command line, the checkpoint saved asynchronously (the default)
  "--config=configs/tiny.py:mlp",
  *MICRO_TRAIN_FLAGS,
  "--config.data.shuffle_buffer=64",
  "--config.train.steps=6",
  "--config.train.accept_schedule_change=True",  # it extends a run of 2 steps
  "--config.train.warmup_steps=1",
  "--config.train.log_every=1",
  "--config.train.eval_every=1000",
  "--config.train.eval_batches=1",
  "--config.checkpoint.every=2",
]


def losses(workdir) -> dict:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {row["step"]: row["loss"] for row in rows if "loss" in row}


def directory_bytes(path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.long  # a system case of half a minute or more: make test-long
@pytest.mark.slow
def test_a_full_disk_during_a_save_ends_in_one_line_and_a_rerun_resumes_bitwise(tmp_path, small_filesystem):
  reference = tmp_path / "reference"
  loop.train(micro_config(steps=6), str(reference))
  workdir = small_filesystem.path / "run"
  loop.train(micro_config(steps=2), str(workdir))  # step 2 complete
  small_filesystem.leave_free(directory_bytes(workdir / "checkpoints" / "2") // 2)  # step 4 does not fit

  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.train", *TRAIN_FLAGS, f"--workdir={workdir}"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == paths.STORAGE_EXIT_CODE, result.stderr
  lines = result.stderr.splitlines()
  last_step = max(i for i, line in enumerate(lines) if "] step " in line)
  assert len(lines) - last_step - 1 <= 5 and "Traceback" not in result.stderr, result.stderr
  assert lines[-1] == (
    f"error: saving checkpoint step 4 in {workdir}/checkpoints failed (No space left on device); the newest "
    "complete checkpoint is step 2 (nothing saved was damaged): free space there (or quota) and run the same "
    "command again to resume from it."
  ), result.stderr
  assert checkpointing.open_read_only(str(workdir)).manager.all_steps() == [2]  # the incomplete step is no step

  small_filesystem.make_room()
  loop.train(micro_config(steps=6, accept_schedule_change=True), str(workdir))
  _, params, step = checkpointing.load(str(workdir))
  _, want, _ = checkpointing.load(str(reference))
  assert step == 6
  jax.tree.map(np.testing.assert_array_equal, params, want)
  assert losses(workdir) == losses(reference)


def test_a_full_disk_under_the_metrics_is_one_storage_error(tmp_path, small_filesystem):
  """metrics.jsonl and TensorBoard's events: the write's failure names the step, the workdir and the OS's words."""
  from sparsetx.train.tracking import metrics

  writer = metrics.make_writer(str(small_filesystem.path / "run"), fix=lambda: "resume from step 2.")
  writer.write_scalars(1, {"loss": 1.0})
  small_filesystem.leave_free(0)
  with pytest.raises(paths.StorageError) as error:
    for step in range(2, 200):  # TensorBoard's writer may buffer a few events
      writer.write_scalars(step, {"loss": 1.0, "x" * 4000: 2.0})
  assert str(error.value).endswith(
    f"'s metrics in {small_filesystem.path / 'run'} failed (No space left on device); resume from step 2."
  )
  assert str(error.value).startswith("writing step ")


@pytest.mark.parametrize("program", ["tokenize", "export"])
def test_tokenize_and_export_on_a_full_disk_end_in_one_line(tmp_path, small_filesystem, program):
  out = small_filesystem.path / "out"
  if program == "tokenize":
    args = ["-m", "sparsetx.tools.tokenize", "--config=configs/tiny.py", f"--output_dir={out}", "--workers=1"]
    small_filesystem.leave_free(200 * 1024)  # the embedded corpus takes about 840 KiB
  else:
    workdir = tmp_path / "run"
    loop.train(micro_config(steps=2), str(workdir))
    args = ["-m", "sparsetx.tools.export", f"--workdir={workdir}", f"--out={out}"]
    small_filesystem.leave_free(64 * 1024)
  result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == paths.STORAGE_EXIT_CODE, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert errors == result.stderr.splitlines()[-1:] and "Traceback" not in result.stderr, result.stderr
  assert "failed (No space left on device); " in errors[0] and "run the same command again" in errors[0]
  if program == "export":
    assert not any(small_filesystem.path.glob("*out*")), list(small_filesystem.path.iterdir())  # nothing partial


def test_the_fix_names_the_fault_the_os_reported(tmp_path):
  fixes = {
    errno.ENOSPC: "free space there (or quota)",
    errno.EDQUOT: "free space there (or quota)",
    errno.EROFS: "make the storage writable again (remount it read-write",
    errno.EACCES: "give this user write permission there",
  }
  for code, fix in fixes.items():
    with pytest.raises(paths.StorageError) as raised:
      with paths.writing(f"writing {tmp_path}/x", paths.FREE_SPACE):
        raise OSError(code, os.strerror(code))
    assert str(raised.value) == f"writing {tmp_path}/x failed ({os.strerror(code)}); " + (
      paths.FREE_SPACE if "free space" in fix else paths.fitting(paths.FREE_SPACE, os.strerror(code))
    )
    assert fix in str(raised.value), str(raised.value)
