"""The asynchronous loop: the host runs a step ahead, the divergence error names the step that diverged,
nothing non-finite is saved; the profiler. (Resume: tests/test_train.py, and on a gs:// workdir with the
metrics after a resume, tests/test_workdir_fs.py.)"""

import json

import jax
import numpy as np
import pytest
from test_train import micro_config

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import global_stream
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop
from sparsetx.train.tracking import metrics as metrics_lib
from sparsetx.train.tracking import profiler as profiler_lib


class _Recorded:
  """Wraps the train iterator: records each batch read in `events` and poisons batch `nan_at` (1-based)."""

  def __init__(self, inner, events, nan_at):
    self._inner, self._events, self._nan_at = inner, events, nan_at

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._inner)
    self._events.append(("batch", self._inner.step))
    if self._inner.step == self._nan_at:  # a NaN loss weight makes this step's loss and update NaN
      batch = dict(batch, loss_weights=batch["loss_weights"] * np.float32(np.nan))
    return batch


def _record(monkeypatch, nan_at=None):
  events = []
  make_stream, make_writer = global_stream.GlobalStream, metrics_lib.make_writer
  monkeypatch.setattr(global_stream, "GlobalStream", lambda *a, **k: _Recorded(make_stream(*a, **k), events, nan_at))

  def writer(*args, **kwargs):
    real = make_writer(*args, **kwargs)
    write = real.write_scalars
    real.write_scalars = lambda step, scalars: (
      events.append(("log", step)) if "loss" in scalars else None,
      write(step, scalars),
    )[1]
    return real

  monkeypatch.setattr(metrics_lib, "make_writer", writer)
  return events


def test_divergence_is_read_one_step_late_names_its_step_and_saves_nothing_non_finite(tmp_path, monkeypatch):
  events = _record(monkeypatch, nan_at=6)
  config = micro_config("mlp", steps=10, warmup_steps=0, profile_steps="2,2")
  config.checkpoint.every = 4
  with pytest.raises(
    loop.NonFiniteLossError, match=r"training diverged at step 6 \(.*loss=nan.*\); nothing after step 4 was saved"
  ):
    loop.train(config, str(tmp_path))
  # The host read step N's metrics only after it had read batch N + 1 (and dispatched step N + 1), except
  # at the checkpoint of step 4, read before the batch of step 5 so that the saved data position is exact.
  order = {event: i for i, event in enumerate(events)}
  for step in (1, 2, 3, 5):
    assert order[("batch", step + 1)] < order[("log", step)], events
  assert order[("log", 4)] < order[("batch", 5)], events
  assert ("log", 6) not in order and ("batch", 7) in order, events  # step 7 was dispatched before 6 was read
  manager = checkpointing.Checkpointer(str(tmp_path), config.checkpoint)
  assert manager.manager.all_steps() == [4]
  abstract, _, _, _ = state_lib.state_shardings(config, mesh_lib.make_mesh(config.mesh))
  state = manager.restore_state(4, abstract)
  manager.close()
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  with open(tmp_path / "metrics.jsonl") as f:
    assert [row["step"] for row in map(json.loads, f) if "loss" in row] == [1, 2, 3, 4, 5]
  # The profile of steps 2 and 3, where TensorBoard's profile plugin looks for it.
  traces = list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0, traces


def test_profile_steps_are_validated():
  config = config_lib.default_config()
  for bad in ("5", "0,3", "2,x", "1,2,3"):
    config.train.profile_steps = bad
    with pytest.raises(config_lib.ConfigError, match=r"config.train.profile_steps=.* must be 'START,COUNT'"):
      config_lib.validate(config)
  config.train.profile_steps = "10,5"
  assert config_lib.profile_steps(config_lib.validate(config).train) == (10, 5)


@pytest.mark.parametrize("process, all_processes, traced", [(0, False, True), (1, False, False), (1, True, True)])
def test_profile_is_written_by_process_0_or_every_process_with_the_flag(
  process, all_processes, traced, monkeypatch, tmp_path
):
  calls = []
  monkeypatch.setattr(jax, "process_index", lambda: process)
  monkeypatch.setattr(jax.profiler, "start_trace", lambda logdir: calls.append(("start", logdir)))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
  train = micro_config(profile_steps="3,2", profile_all_processes=all_processes).train
  profiler = profiler_lib.Profiler(train, paths.resolve(str(tmp_path)))
  for step in range(1, 7):
    profiler.before(step)
    calls.append(("step", step))
    profiler.after(step, {})
  profiler.close()
  steps = [("step", s) for s in range(1, 7)]
  want = steps[:2] + [("start", str(tmp_path)), *steps[2:4], ("stop",), *steps[4:]] if traced else steps
  assert calls == want
