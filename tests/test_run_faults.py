"""What a bad day brings to a long run, in one process: a row of skips or a share of them ends a `skip` run (exit 3,
one sentence), a rollback with keep=1 restores the checkpoint saved inside the row instead of starting over, a run
with no checkpoint to roll back to stops instead of starting from nothing, the agreement on SIGTERM and saves by time
starts again after a rollback, and the watchdog gives what is slow on purpose its own limit.
(Subprocesses, kill -9 and slow storage: tests/test_run_faults_system.py.)"""

import json
import logging
import subprocess
import sys

import jax
import numpy as np
import poisoned_stream
import pytest
from conftest import REPO
from test_bad_steps import config_for, metric_rows, saved_states
from test_train import losses

from sparsetx.train import step as step_lib
from sparsetx.train.run import agreement as agreement_lib
from sparsetx.train.run import loop, recovery, watchdog


def test_a_row_of_skips_ends_a_skip_run_naming_the_steps_and_the_window(tmp_path, monkeypatch):
  # Batches 10 to 15 spike: the third skip in a row ends the run; nothing after it is trained.
  poisoned_stream.install(monkeypatch, spikes=range(10, 16))
  config = config_for("skip", steps=20)
  config.train.max_bad_in_row = 3
  with pytest.raises(recovery.BadStepsError) as raised:
    loop.train(config, str(tmp_path))
  assert str(raised.value).startswith("steps 10 to 12 were all skipped (3 steps skipped in a row, the last for loss")
  assert "--config.data.skip_steps=10:12 " in str(raised.value) and "the newest checkpoint is step 10" in str(
    raised.value
  )
  assert max(metric_rows(tmp_path)) == 11  # the row's last step stops the run before its metrics are written


def test_a_skip_run_stops_when_too_many_of_its_last_steps_were_skipped(tmp_path, monkeypatch):
  # Spikes at 8 and 10, never two in a row: 2 of the last 6 steps (5 to 10) is more than 0.3 x 6.
  poisoned_stream.install(monkeypatch, spikes=[8, 10])
  config = config_for("skip", steps=14, skipped_share_window=6, max_skipped_share=0.3)
  with pytest.raises(recovery.BadStepsError, match=r"^2 of the last 6 steps were skipped, through step 10 \(more "):
    loop.train(config, str(tmp_path))
  assert [s for s, row in metric_rows(tmp_path).items() if row["skipped"]] == [8]  # step 10 stopped it


def test_the_skipped_share_holds_across_a_resume(tmp_path, monkeypatch):
  # The same spikes, the run stopped at step 9 and resumed: the device's record of the last steps came along.
  poisoned_stream.install(monkeypatch, spikes=[8, 10])
  config = config_for("skip", steps=9, skipped_share_window=6, max_skipped_share=0.3)
  loop.train(config, str(tmp_path))
  config.train.update(steps=14, accept_schedule_change=True)  # a longer run: its schedule changes
  with pytest.raises(recovery.BadStepsError, match=r"^2 of the last 6 steps were skipped, through step 10 \(more "):
    loop.train(config, str(tmp_path))


def test_a_resume_inside_a_row_counts_its_own_row_and_names_its_own_batches(tmp_path, monkeypatch):
  # Steps 10 and 11 skipped and saved; the resume at 11 skips 12 to 14 before it stops, and names them.
  poisoned_stream.install(monkeypatch, spikes=range(10, 16))
  config = config_for("skip", steps=11)
  config.checkpoint.every = 1
  config.train.max_bad_in_row = 3
  loop.train(config, str(tmp_path))
  config.train.update(steps=20, accept_schedule_change=True)  # a longer run: its schedule changes
  with pytest.raises(recovery.BadStepsError, match=r"^steps 12 to 14 were all skipped .*skip_steps=12:14 "):
    loop.train(config, str(tmp_path))


def test_a_rollback_with_keep_1_restores_the_checkpoint_saved_inside_the_row(tmp_path, monkeypatch, caplog):
  # Every step saved, one kept: when step 13 rolls back, the only checkpoint is step 12, skipped, whose parameters
  # are step 11's. The run goes on from it, stepping over batch 13 only, as a run given that window by hand does.
  poisoned_stream.install(monkeypatch, spikes=[12, 13])
  rolled, by_hand = tmp_path / "rolled", tmp_path / "by_hand"
  config = config_for("rollback", steps=15)
  config.checkpoint.update(every=1, keep=1)
  steps = []
  make_train_step = step_lib.make_train_step
  monkeypatch.setattr(step_lib, "make_train_step", lambda *a: steps.append(make_train_step(*a)) or steps[-1])
  with caplog.at_level(logging.WARNING, logger="absl"):
    loop.train(config, str(rolled))
  assert any(r.getMessage().startswith("Rolled back to step 12 after step 13") for r in caplog.records)
  assert steps[0]._cache_size() == 1  # the restored state is typed as the fresh one: the step compiled once
  windows = json.loads((rolled / recovery.RECORD).read_text())["windows"]
  assert [(w["steps"], w["restored_step"]) for w in windows] == [("13:13", 12)]
  hand = config_for("rollback", steps=15)
  hand.checkpoint.update(every=100, keep=1)  # saves step 15 only
  hand.data.update(skip_steps="13:13", tokenized_dir=str(rolled / "tokenized"))
  poisoned_stream.install(monkeypatch, spikes=[12])
  loop.train(hand, str(by_hand))
  want, got = losses(by_hand), losses(rolled)
  assert all(got[s] == want[s] for s in range(14, 16)), (got, want)
  for a, b in zip(*(jax.tree.leaves(saved_states(config, str(w), [15])[15].params) for w in (rolled, by_hand))):
    np.testing.assert_array_equal(a, b)


def test_a_rollback_with_no_checkpoint_to_restore_stops_in_one_sentence(tmp_path, monkeypatch):
  poisoned_stream.install(monkeypatch, spikes=[8, 9])
  config = config_for("rollback", steps=12)
  config.checkpoint.every = 100
  with pytest.raises(recovery.BadStepsError, match=r"no checkpoint at or before step 9 exists .*skip_steps=8:9,"):
    loop.train(config, str(tmp_path))
  assert not (tmp_path / recovery.RECORD).exists()  # no window from step 1 recorded


def test_after_a_rollback_sigterm_and_saves_by_time_are_agreed_again(monkeypatch):
  """Two processes, as one sees them: each agreement fixes the next; a rollback to an earlier step must not wait for
  the step the run had reached."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(agreement_lib.multihost_utils, "process_allgather", lambda votes: np.stack([votes, votes]))
  agreement = agreement_lib.Agreement(every_minutes=0.0)
  try:
    agreement.read(0.01)  # 10 ms steps: the next agreement 500 steps on
    assert agreement.at(400) == (False, False)
    agreement.raised = True  # SIGTERM after a rollback from step 420 to step 380
    agreement.rewound(380)
    assert agreement.at(381) == (True, False)
  finally:
    agreement.restore()


SLOW = r"""
import sys, time
from sparsetx.train.run import watchdog
dog = watchdog.Watchdog(float(sys.argv[1]), slow=dict(save=float(sys.argv[2])))
dog.progress(7, 0.01)
dog.doing("saving step 8", "save")
time.sleep(float(sys.argv[3]))
dog.doing("step 9")
time.sleep(0.5)
print("finished")
"""


@pytest.mark.parametrize("save_timeout, exits", [(30.0, 0), (1.0, watchdog.WATCHDOG_EXIT_CODE)])
def test_a_save_has_its_own_limit(save_timeout, exits):
  # A 3 s save under a 1 s step limit: healthy under a 30 s save limit, a hang under a 1 s one.
  result = subprocess.run(
    [sys.executable, "-c", SLOW, "1", str(save_timeout), "3"], cwd=REPO, capture_output=True, text=True, timeout=60
  )
  assert result.returncode == exits, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  if exits:
    assert len(errors) == 1 and "(config.train.save_timeout_s=1.0: 1 s) while running saving step 8;" in errors[0]
  else:
    assert not errors and result.stdout == "finished\n"


def test_the_slow_kinds_derive_their_limits_from_their_own_measurements():
  dog = watchdog.Watchdog(5.0, slow=dict(restore=60.0))
  try:
    assert dog.limit("step") == 5.0 and dog.limit("restore") == 60.0
    assert dog.limit("save") == dog.limit("compile") == watchdog.SLOW_FLOORS_S["save"]
    dog.measured("save", 1000.0)
    dog.measured("step", 1000.0)  # a save's time is not a step's
    assert dog.limit("save") == watchdog.SLOW_FACTOR * 1000.0 and dog.limit("compile") == watchdog.SLOW_FLOORS_S["save"]
  finally:
    dog.close()
