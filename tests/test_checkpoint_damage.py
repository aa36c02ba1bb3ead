"""A damaged checkpoint ends in one line naming the step, what is wrong and the older steps to use, for
training (`--config.checkpoint.restore_step=N`) and for the readers (`--step=N`); nothing in the workdir
changes. Resuming from the older step with restore_step reproduces the lost step exactly.

One MLP run of 4 steps (checkpoints at 2 and 4) is trained once; each test damages a copy of it.
"""

import asyncio
import errno
import gc
import glob
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import logging as absl_logging
from conftest import REPO, load_config

from sparsetx import paths
from sparsetx.interp import checkpoint as interp_checkpoint
from sparsetx.train.checkpoints import checkpointing, held_errors
from sparsetx.train.run import loop


def micro_config(ffn_type: str = "mlp", **train):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(d_model=64, n_layers=2, max_len=32, dtype="float32")
  config.data.update(seq_len=32, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64)
  config.train.update(dict(steps=4, warmup_steps=1, log_every=1, eval_every=1000, eval_batches=1), **train)
  config.checkpoint.update(every=2, async_save=False)
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp("trained") / "run")
  loop.train(micro_config(), workdir)
  return workdir


@pytest.fixture
def copy(trained, tmp_path) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  return workdir


def tree(workdir: str) -> dict:
  """Every directory and file under `workdir` with its bytes: what a refused run must leave unchanged."""
  found = {}
  for root, dirs, files in os.walk(workdir):
    for name in dirs:
      found[os.path.relpath(os.path.join(root, name), workdir) + "/"] = None
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        found[os.path.relpath(os.path.join(root, name), workdir)] = f.read()
  return found


def truncate(path: str) -> None:
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[: len(data) // 2])


def delete(pattern: str) -> None:
  paths = glob.glob(pattern)
  assert paths, pattern
  for path in paths:
    os.remove(path)


def empty_step(step_dir: str) -> None:
  shutil.rmtree(step_dir)
  os.mkdir(step_dir)


STEP = "{w}/checkpoints/4"
DAMAGES = {  # name: (damage of the newest step, what the message says is wrong)
  "config JSON cut short": (
    lambda w: truncate(f"{STEP.format(w=w)}/config/metadata"),
    "its saved config is unreadable",
  ),
  "config deleted": (lambda w: delete(f"{STEP.format(w=w)}/config/metadata"), "its saved config is unreadable"),
  "array metadata cut short": (
    lambda w: truncate(f"{STEP.format(w=w)}/state/_METADATA"),
    "the metadata of its arrays is unreadable",
  ),
  "array files deleted": (
    lambda w: delete(f"{STEP.format(w=w)}/state/d/*"),
    "the metadata of its arrays is unreadable",
  ),
  "array chunks deleted": (lambda w: delete(f"{STEP.format(w=w)}/state/ocdbt.process_0/d/*"), "reading it failed"),
  "state item deleted": (lambda w: shutil.rmtree(f"{STEP.format(w=w)}/state"), "its 'state' item"),
  "empty step directory": (lambda w: empty_step(STEP.format(w=w)), "holds no checkpoint items"),
  "data item deleted": (lambda w: shutil.rmtree(f"{STEP.format(w=w)}/data"), "its 'data' item"),
  "data state JSON garbage": (
    lambda w: open(f"{STEP.format(w=w)}/data/metadata", "w").write("garbage"),
    "its data state is unreadable",
  ),
}
READER_SEES = ("config", "array", "state item", "empty")  # the readers need no data state


@pytest.mark.parametrize("name", DAMAGES)
def test_damaged_newest_step_is_one_error_and_changes_nothing(copy, name):
  damage, problem = DAMAGES[name]
  damage(copy)
  before = tree(copy)
  with pytest.raises(checkpointing.CheckpointError) as error:
    loop.train(micro_config(steps=6, accept_schedule_change=True), copy)
  message = str(error.value)
  assert message.startswith(f"checkpoint step 4 in {copy}/checkpoints cannot be read: ") and problem in message
  assert (
    message.endswith(
      "pick an older complete step with --config.checkpoint.restore_step=N (saved steps: 2); nothing was deleted."
    )
    and "\n" not in message
  )
  if any(word in name for word in READER_SEES):
    with pytest.raises(checkpointing.CheckpointError, match=r"with --step=N \(saved steps: 2\)"):
      interp_checkpoint.load(copy)
  assert tree(copy) == before


def test_resume_from_an_older_step_reproduces_the_damaged_one(trained, copy):
  truncate(f"{copy}/checkpoints/4/config/metadata")
  damaged = tree(f"{copy}/checkpoints/4")
  config = micro_config()
  config.checkpoint.restore_step = 2
  loop.train(config, copy)
  superseded = glob.glob(f"{copy}/{checkpointing.SUPERSEDED}/*/checkpoints/4")
  assert len(superseded) == 1 and tree(superseded[0]) == damaged  # set aside as it was, not deleted
  assert os.path.isdir(os.path.join(superseded[0], "data"))  # its data position with it
  _, model, step = interp_checkpoint.load(copy)
  _, want, _ = interp_checkpoint.load(trained)
  assert step == 4
  jax.tree.map(np.testing.assert_array_equal, model.params, want.params)  # bit-identical to the uninterrupted run


def test_resume_with_another_feed_forward_type_names_the_type(copy):
  before = tree(copy)
  with pytest.raises(
    checkpointing.ConfigError,
    match=r'^config.model.ffn.type="fff" but the checkpoint .* was '
    r'trained with "mlp"',
  ):
    loop.train(micro_config("fff", steps=6, accept_schedule_change=True), copy)
  assert tree(copy) == before


def test_restore_step_that_was_not_saved_is_refused(copy):
  config = micro_config(steps=6, accept_schedule_change=True)
  config.checkpoint.restore_step = 3
  before = tree(copy)
  with pytest.raises(
    checkpointing.CheckpointError, match=r"restore_step=3 is not a saved step .*; saved steps: 2, 4\."
  ):
    loop.train(config, copy)
  assert tree(copy) == before


def delete_half(step_dir: str) -> None:
  """Every other file of the step (sorted), what a partly lost copy leaves: metadata and chunks alike."""
  files = sorted(os.path.join(root, name) for root, _, names in os.walk(step_dir) for name in names)
  for path in files[1::2]:
    os.remove(path)


# The evaluate program, after a failed read's sibling task (its error never retrieved) is collected while the
# step's arrays are read: what a restore whose reads fail together can leave to the collector at any moment.
WITH_A_COLLECTED_SIBLING = """
import asyncio, gc, runpy, sys
import orbax.checkpoint as ocp

real_restore = ocp.CheckpointManager.restore

def restore(self, step, args=None, **kwargs):
  if args is not None and "state" in args:
    async def sibling_read():  # orbax's words: the index, then the array's TensorStore spec, which names its file
      raise Exception(
        "Encountered error while reading array index: (slice(0, 8, 1),). See full TensorStore details: "
        f"{{'kvstore': {{'driver': 'file', 'path': '{self.directory}/{step}/state/ocdbt.process_0/'}}}}."
      )
    loop = asyncio.new_event_loop()
    task = loop.create_task(sibling_read())
    loop.run_until_complete(asyncio.sleep(0))  # the task has failed; nothing will await it
    loop.close()
    del task
    gc.collect()
  return real_restore(self, step, args=args, **kwargs)

ocp.CheckpointManager.restore = restore
sys.argv = ["evaluate", *sys.argv[1:]]
runpy.run_module("sparsetx.evaluate", run_name="__main__")
"""


@pytest.mark.parametrize(
  "damage, problem, program",
  [
    # Found by the restore itself, whose reads still in flight must print nothing after the line.
    (
      lambda w: delete(f"{w}/checkpoints/4/state/ocdbt.process_0/d/*"),
      "reading it failed (",
      ["-m", "sparsetx.evaluate"],
    ),
    (
      lambda w: delete_half(f"{w}/checkpoints/4"),
      "cannot be read: ",
      ["-m", "sparsetx.evaluate"],
    ),  # ckpt_files_deleted
    (
      lambda w: delete(f"{w}/checkpoints/4/state/ocdbt.process_0/d/*"),
      "reading it failed (",
      ["-c", WITH_A_COLLECTED_SIBLING],
    ),
  ],
  ids=["array chunks deleted", "ckpt_files_deleted", "a sibling read's failure collected"],
)
def test_evaluate_reports_a_damaged_step_as_its_only_output(copy, damage, problem, program):
  """The program's whole stderr is the one line, newline-terminated: no orbax warning before it, no
  tensorstore 'Event loop is closed' traceback and no asyncio 'Task exception was never retrieved' around it
  (cli.run ends the process at once)."""
  damage(copy)
  before = tree(copy)
  result = subprocess.run(
    [sys.executable, *program, f"--workdir={copy}"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 2, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and result.stderr.endswith("\n"), result.stderr
  assert lines[0].startswith(f"error: checkpoint step 4 in {copy}/checkpoints cannot be read: ") and problem in lines[0]
  assert lines[0].endswith("pick an older complete step with --step=N (saved steps: 2); nothing was deleted.")
  assert tree(copy) == before


def raise_unraisable(error: BaseException) -> None:
  """Raises `error` where Python can only report it to sys.unraisablehook: in a finalizer."""

  class Finalized:
    def __del__(self):
      raise error

  Finalized()


def collect_a_failed_task(error: BaseException) -> None:
  """An asyncio task that failed with `error` and that nobody awaited, collected: asyncio logs 'Task exception was
  never retrieved'."""

  async def fail():
    raise error

  loop = asyncio.new_event_loop()
  task = loop.create_task(fail())
  loop.run_until_complete(asyncio.sleep(0))
  loop.close()
  del task
  gc.collect()


def test_an_unrelated_error_prints_during_and_after_a_failed_restore(copy, monkeypatch, caplog):
  """The echoes of a failed read are held only while it runs, and only those naming its step are dropped: an
  unrelated OSError (a full disk elsewhere) raised during the read and after it reaches the hook as it would
  without any, and an unrelated task's failure is logged."""
  delete(f"{copy}/checkpoints/4/state/ocdbt.process_0/d/*")
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_value))
  during = OSError(errno.ENOSPC, "No space left on device", "/elsewhere/during.log")
  after = OSError(errno.ENOSPC, "No space left on device", "/elsewhere/after.log")
  real_restore = ocp.CheckpointManager.restore

  def restore(self, step, args=None, **kwargs):
    if args is not None and "state" in args:
      raise_unraisable(during)
    return real_restore(self, step, args=args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
  with pytest.raises(checkpointing.CheckpointError, match="reading it failed"):
    checkpointing.load(copy, full_state=True)
  raise_unraisable(after)
  collect_a_failed_task(OSError(errno.ENOSPC, "No space left on device"))
  assert [error for error in reported if error in (during, after)] == [during, after]
  assert any("Task exception was never retrieved" in record.getMessage() for record in caplog.records)
  assert not any(isinstance(f, held_errors.HeldErrors) for f in logging.getLogger("asyncio").filters)


def test_an_error_logged_while_a_damaged_step_is_checked_still_prints(copy, monkeypatch, caplog):
  """Orbax's warnings about the damaged step are dropped with its one-line error; an ERROR logged through absl at the
  same moment (another thread's failure) and another library's warning pass at once."""
  delete(f"{copy}/checkpoints/4/state/_METADATA")
  real_verify = checkpointing.Checkpointer._verify

  def verify(self, step, data_state):
    absl_logging.error("an unrelated failure: No space left on device")
    absl_logging.warning("a warning of some library")
    return real_verify(self, step, data_state)

  monkeypatch.setattr(checkpointing.Checkpointer, "_verify", verify)
  with pytest.raises(checkpointing.CheckpointError, match="cannot be read"):
    checkpointing.load(copy)
  messages = [record.getMessage() for record in caplog.records]
  assert "an unrelated failure: No space left on device" in messages and "a warning of some library" in messages


def test_a_full_disk_save_after_a_failed_restore_is_one_error(copy, small_filesystem):
  """A long-lived process (the lm-eval adapter) whose restore failed, then saves on a full disk: the save's
  failure is its one StorageError line with the OS's words, not dropped as the failed read's echo."""
  delete(f"{copy}/checkpoints/4/state/ocdbt.process_0/d/*")
  with pytest.raises(checkpointing.CheckpointError, match="reading it failed"):
    checkpointing.load(copy, full_state=True)
  config, params, _ = checkpointing.load(copy, step=2)
  config.checkpoint.async_save = True
  workdir = small_filesystem.path / "run"
  checkpointer = checkpointing.Checkpointer(str(workdir), config.checkpoint)
  small_filesystem.leave_free(64 * 1024)
  with pytest.raises(paths.StorageError) as error:
    checkpointer.save(7, params, config, data_state=None)
    checkpointer.wait()
  checkpointer.close()
  assert str(error.value) == (
    f"saving checkpoint step 7 in {workdir}/checkpoints failed (No space left on device); no checkpoint is "
    "complete yet: free space there (or quota) and run the same command again."
  )
