"""Bad steps (config.train.bad_steps): the device's rule against a NumPy transcription of Levanter's (rolling mean +
k standard deviations of the last W accepted steps), skipped updates that leave the state bitwise as it was, a
rollback that steps over the data like a window given by hand, a step saved before the record existed, and the
stream's and the record's windows. (Two processes and kill -9: tests/test_bad_steps_system.py.)"""

import json
import logging
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import poisoned_stream
import pytest
from flax.training import train_state
from test_train import losses, micro_config

from sparsetx import config as config_lib
from sparsetx.data import global_stream
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import bad_steps
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop, recovery


def reference_skips(losses_, grad_norms, window, sigmas):
  """Which steps Levanter's rule skips, in NumPy: non-finite, or above mean + sigmas * std of the last `window`
  accepted values of either series (none before `window` were accepted)."""
  accepted, skips = [], []
  for loss, norm in zip(losses_, grad_norms):
    skip = not (np.isfinite(loss) and np.isfinite(norm))
    if len(accepted) >= window:
      last = np.array(accepted[-window:], np.float64)
      limit = last.mean(0) + sigmas * last.std(0)
      skip |= bool(loss > limit[0] or norm > limit[1])
    skips.append(skip)
    if not skip:
      accepted.append((loss, norm))
  return skips


def test_the_device_rule_is_the_rolling_mean_plus_sigmas_of_accepted_steps():
  rng = np.random.default_rng(0)
  losses_ = list(5.0 - 0.01 * np.arange(40) + 0.02 * rng.standard_normal(40))
  norms = list(2.0 + 0.05 * rng.standard_normal(40))
  losses_[3] = np.nan  # before the window is full: only non-finite values are skipped
  losses_[12], norms[20], norms[21] = 9.0, np.inf, 7.0  # a loss spike, a non-finite norm, a norm spike
  losses_[30] = losses_[29] + 0.02  # within the window's spread: accepted
  train = config_lib.default_config().train
  train.update(bad_steps="skip", spike_window=8, spike_sigmas=6.0)
  step = jax.jit(lambda health, loss, norm: _judged(health, loss, norm, train))
  health, skips, in_row = bad_steps.fresh(train), [], []
  for loss, norm in zip(losses_, norms):
    skip, health = step(health, jnp.float32(loss), jnp.float32(norm))
    skips.append(bool(skip))
    in_row.append(int(health.bad_in_row))
  want = reference_skips(np.float32(losses_), np.float32(norms), 8, 6.0)
  assert skips == want and [i for i, s in enumerate(want) if s] == [3, 12, 20, 21]
  assert in_row[20:23] == [1, 2, 0] and int(health.skipped) == 4 and int(health.accepted) == 36
  train.bad_steps = "stop"  # a constant False: nothing is selected
  assert bad_steps.judge(health, jnp.float32(np.nan), jnp.float32(1.0), train)[0] is False


def _judged(health, loss, norm, train):
  skip, _ = bad_steps.judge(health, loss, norm, train)
  return skip, bad_steps.record(health, skip, loss, norm)


def config_for(mode, steps=16, **train):
  config = micro_config("mlp", steps=steps, bad_steps=mode, spike_window=5, max_bad_in_row=2, **train)
  config.checkpoint.update(every=5, keep=20)
  return config


def saved_states(config, workdir, steps):
  manager = checkpointing.Checkpointer(workdir, config.checkpoint)
  abstract, _, _, _ = state_lib.state_shardings(config, mesh_lib.make_mesh(config.mesh))
  try:
    return {step: jax.device_get(manager.restore_state(step, abstract)) for step in steps}
  finally:
    manager.close()


def metric_rows(workdir):
  with open(f"{workdir}/metrics.jsonl") as f:
    return {row["step"]: row for row in map(json.loads, f) if "loss" in row}


def test_skip_leaves_the_state_bitwise_as_it_was_and_names_each_skipped_step(tmp_path, monkeypatch, caplog):
  # Batches 10 and 11 spike (targets no text holds), 13 is NaN; the window of 5 is full from step 6 on.
  poisoned_stream.install(monkeypatch, spikes=[10, 11], nans=[13])
  config = config_for("skip", steps=14)
  config.checkpoint.every = 1
  config.train.max_bad_in_row = 3  # two in a row (10, 11) are skipped and the run goes on
  with caplog.at_level(logging.WARNING, logger="absl"):
    loop.train(config, str(tmp_path))
  rows = metric_rows(tmp_path)
  assert [s for s, row in rows.items() if row["skipped"]] == [10, 11, 13] and rows[14]["skipped_steps"] == 3
  lines = [r.getMessage() for r in caplog.records if "skipped:" in r.getMessage()]
  assert len(lines) == 3 and lines[2] == "step 13 skipped: non-finite loss (nan); the update was not applied."
  assert lines[0].startswith(f"step 10 skipped: loss {rows[10]['loss']:.4g} > {rows[10]['loss_limit']:.4g}")
  assert rows[10]["loss"] > rows[10]["loss_limit"] and rows[9]["loss"] < rows[9]["loss_limit"]
  states = saved_states(config, tmp_path, [9, 10, 11, 12, 13])
  for before, after in ((9, 10), (9, 11), (12, 13)):
    assert int(states[after].step) == after
    for a, b in zip(
      jax.tree.leaves((states[before].params, states[before].opt_state)),
      jax.tree.leaves((states[after].params, states[after].opt_state)),
    ):
      np.testing.assert_array_equal(a, b)
  assert not all(np.array_equal(a, b) for a, b in zip(*(jax.tree.leaves(states[s].params) for s in (11, 12))))
  # The schedule follows applied updates: step 14 applies the 12th (count 11 before it).
  assert rows[14]["learning_rate"] == pytest.approx(float(step_lib.learning_rate_schedule(config.train)(11)))


def test_rollback_steps_over_the_data_like_a_window_given_by_hand(tmp_path, monkeypatch, caplog):
  # Batches 12 and 13 spike: two skipped in a row roll back to step 10 and step over batches 11 to 13.
  poisoned_stream.install(monkeypatch, spikes=[12, 13])
  rolled, by_hand = tmp_path / "rolled", tmp_path / "by_hand"
  config = config_for("rollback")
  with caplog.at_level(logging.WARNING, logger="absl"):
    loop.train(config, str(rolled))
  assert any(r.getMessage().startswith("Rolled back to step 10 after step 13") for r in caplog.records)
  record = json.loads((rolled / recovery.RECORD).read_text())["windows"]
  assert [(w["steps"], w["restored_step"]) for w in record] == [("11:13", 10)]
  assert recovery.windows(config, str(rolled)) == ((11, 13),)  # what every later run in the workdir steps over
  # The same checkpoint, the same window given by hand: the same run, bitwise.
  shutil.copytree(rolled / "checkpoints" / "10", by_hand / "checkpoints" / "10")
  hand = config_for("rollback")
  hand.data.skip_steps = "11:13"
  hand.data.tokenized_dir = str(rolled / "tokenized")
  loop.train(hand, str(by_hand))
  want, got = losses(rolled), losses(by_hand)
  assert sorted(got) == list(range(11, 17)) and all(got[s] == want[s] for s in got), (got, want)
  states = [saved_states(config, str(workdir), [16])[16] for workdir in (rolled, by_hand)]
  for a, b in zip(*(jax.tree.leaves(s) for s in states)):
    np.testing.assert_array_equal(a, b)
  # The workdir has used its one rollback: the next trouble stops, naming the windows tried.
  config.train.max_rollbacks = 1
  with pytest.raises(recovery.BadStepsError, match=r"after 1 rollbacks .*data windows stepped over: 11:13\)"):
    recovery.check_rollbacks_left(str(rolled), config.train, recovery.RollBack(40, 39, "2 steps skipped in a row"))


class OldTrainState(train_state.TrainState):
  """The train state as sparsetx saved it before the bad-step record."""


def test_a_step_saved_without_the_record_resumes_with_an_empty_one(tmp_path, caplog):
  new, old = str(tmp_path / "new"), str(tmp_path / "old")
  config = config_for("skip", steps=6)
  config.checkpoint.every = 4
  loop.train(config, new)  # saves steps 4 and 6
  manager = checkpointing.Checkpointer(new, config.checkpoint)
  abstract, _, _, _ = state_lib.state_shardings(config, mesh_lib.make_mesh(config.mesh))
  state, data_state = manager.restore_state(4, abstract), manager.data_state(4)
  manager.close()
  assert int(state.health.accepted) == 4
  older = checkpointing.Checkpointer(old, config.checkpoint)
  older.save(4, OldTrainState(4, None, state.params, None, state.opt_state), config, data_state)
  older.close()
  config.data.tokenized_dir = f"{new}/tokenized"
  with caplog.at_level(logging.WARNING, logger="absl"):
    loop.train(config, old)
  assert any("Checkpoint step 4 has no bad-step record" in r.getMessage() for r in caplog.records)
  want, got = losses(new), losses(old)
  assert sorted(got) == [5, 6] and got[5] == want[5] and got[6] == want[6]
  resumed = saved_states(config, old, [6])[6]
  assert int(resumed.health.accepted) == 2 and int(resumed.health.skipped) == 0  # counted from the resume


def test_the_stream_steps_over_its_windows_and_keeps_its_mapping():
  stream = types.SimpleNamespace(skip=((3, 4), (5, 5), (9, 12)))
  unskipped = global_stream.GlobalStream.unskipped
  # 0-based positions: 2, 3 and 4 (steps 3 to 5) and 8 to 11 are stepped over.
  assert [unskipped(stream, p) for p in range(13)] == [0, 1, 5, 5, 5, 5, 6, 7, 12, 12, 12, 12, 12]


def test_a_damaged_record_is_one_line(tmp_path):
  (tmp_path / recovery.RECORD).write_text('{"windows": [{"steps": "12"}]}')
  with pytest.raises(config_lib.ConfigError, match=r"skipped_data.json is not a record of skipped data windows"):
    recovery.windows(config_lib.default_config(), str(tmp_path))


def test_stop_names_skip_and_skip_names_rollback():
  train = config_lib.default_config().train
  values = dict(loss=np.nan, grad_norm=1.0, param_norm=2.0, skipped=0.0, bad_in_row=0.0)
  values.update(loss_limit=np.inf, grad_norm_limit=np.inf)
  with pytest.raises(recovery.NonFiniteLossError, match=r"diverged at step 7 .*bad_steps=skip\), then resume"):
    recovery.verdict(7, values, train, saved_step=5)
  train.bad_steps = "skip"
  recovery.verdict(7, dict(values, skipped=1.0, bad_in_row=1.0), train, saved_step=5)  # the device skipped it
  with pytest.raises(recovery.NonFiniteLossError, match=r"param_norm=inf\); .*bad_steps=rollback\)"):
    recovery.verdict(7, dict(values, param_norm=np.inf), train, saved_step=5)
  train.bad_steps = "rollback"
  with pytest.raises(recovery.RollBack):
    recovery.verdict(7, dict(values, param_norm=np.inf), train, saved_step=5)
