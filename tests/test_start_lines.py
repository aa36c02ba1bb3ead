"""A run says what its start is: a fresh start at step 0, the config taken by default (from any directory), a finished
run and how to extend it; a resume whose learning-rate schedule changes refuses, naming the change, until confirmed."""

import logging
import subprocess
import sys

import ml_collections
import pytest
from conftest import REPO
from test_train import losses, micro_config

from sparsetx import config as config_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop, restore


def messages(caplog) -> str:
  return "\n".join(record.getMessage() for record in caplog.records)


def test_a_start_a_finished_run_and_a_changed_schedule_each_say_so(tmp_path, caplog):
  workdir = str(tmp_path / "w")
  config = micro_config("mlp", steps=2, warmup_steps=1)
  with caplog.at_level(logging.INFO, logger="absl"):
    loop.train(config, workdir)
  assert f"No checkpoint in {workdir}/checkpoints: starting at step 0." in messages(caplog)

  caplog.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    loop.train(config, workdir)  # the same command again
  assert "starting at step 0" not in messages(caplog)
  assert (
    f"The run in {workdir} is finished (step 2, config.train.steps=2): nothing to train. To train further, run "
    "again with a larger --config.train.steps and --config.train.accept_schedule_change=True"
  ) in messages(caplog)

  longer = micro_config("mlp", steps=4, warmup_steps=1)
  with pytest.raises(
    config_lib.ConfigError,
    match=r"^the checkpoint at step 2 in .*checkpoints was trained with another learning-rate schedule "
    r"\(config.train.steps 2 -> 4\): step 3's rate would be 0.001 instead of the saved schedule's 0; add "
    r"--config.train.accept_schedule_change=True to resume under the new one, or set the fields back\.$",
  ):
    loop.train(longer, workdir)
  assert max(losses(workdir)) == 2
  manager = checkpointing.Checkpointer(workdir, longer.checkpoint)
  assert manager.manager.all_steps() == [2]  # the refused resume wrote nothing
  manager.close()

  longer.train.accept_schedule_change = True
  loop.train(longer, workdir)
  assert max(losses(workdir)) == 4


def train_config(**fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(dict(steps=100, schedule="wsd", learning_rate=1e-3, warmup_steps=10, decay_fraction=0.2), **fields)
  )


def test_only_a_change_of_the_rates_still_to_come_is_refused():
  # No decay: the rates after warmup are the peak whatever the length, so a longer run changes nothing.
  restore.check_schedule(train_config(decay_fraction=0.0), train_config(steps=300, decay_fraction=0.0), 50, "W")
  restore.check_schedule(train_config(), train_config(), 50, "W")  # nothing changed
  for change in (dict(steps=300), dict(learning_rate=3e-4), dict(schedule="cosine"), dict(decay_fraction=0.5)):
    with pytest.raises(config_lib.ConfigError, match=f"config.train.{next(iter(change))} .* -> "):
      restore.check_schedule(train_config(), train_config(**change), 50, "W")
  # A warmup that ended before the resume: every rate still to come is the same.
  restore.check_schedule(train_config(), train_config(warmup_steps=20), 50, "W")
  with pytest.raises(config_lib.ConfigError, match=r"step 6's rate would be 0.00025 instead of the saved .* 0.0005"):
    restore.check_schedule(train_config(), train_config(warmup_steps=20), 5, "W")  # inside the warmup
  # Longer: the saved run's decay starts after count 80 (100 x (1 - 0.2)), the longer run's at 240, so the first
  # update whose rate changes is count 81, step 82, long after the resume; the new rate there is still the peak.
  with pytest.raises(config_lib.ConfigError, match=r"step 82's rate would be 0.001 instead of the saved schedule's"):
    restore.check_schedule(train_config(), train_config(steps=300), 50, "W")
  accepted = train_config(steps=300, accept_schedule_change=True)
  restore.check_schedule(train_config(), accepted, 50, "W")


def test_the_default_config_is_named_and_found_outside_the_repository(tmp_path):
  (tmp_path / "file").write_text("")  # the workdir's parent is a file: the run stops before anything is built
  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.train", f"--workdir={tmp_path / 'file' / 'run'}"],
    cwd=tmp_path,  # not the repository root: the default is found beside the package
    capture_output=True,
    text=True,
    timeout=300,
  )
  lines = result.stderr.strip().splitlines()
  assert f"No --config given: training the default, configs/tiny.py ({REPO}/configs/tiny.py" in lines[0], lines
  assert result.returncode == 2 and lines[-1].startswith(f"error: --workdir={tmp_path}/file/run is not writable"), lines
