"""Goodput (sparsetx/train/run/goodput.py): the trainer's parts add up to the wall time measured around it, a resume from
an earlier step counts the steps it repeats as redone, and the totals add up over the runs of one workdir."""

import json
import logging
import time

import jax
import pytest
from jax._src import compilation_cache, monitoring
from test_train import micro_config

from sparsetx.train.run import goodput, loop


def record(workdir) -> dict:
  return json.loads((workdir / goodput.RECORD).read_text())


def test_the_parts_add_up_to_the_wall_time_and_a_resume_counts_redone_steps(tmp_path):
  config = micro_config("mlp", steps=8)
  config.checkpoint.update(every=4, keep=5)
  began = time.time()
  last = loop.train(config, str(tmp_path))
  wall = time.time() - began
  first = record(tmp_path)
  parts = sum(first["seconds"].values())
  assert abs(parts - wall) <= 0.02 * wall, (parts, wall, first)
  assert first["runs"] == 1 and first["reached"] == 8 and first["seconds"]["redone_steps"] == 0.0
  assert all(first["seconds"][name] > 0 for name in ("init", "compile", "steps", "checkpoint", "evaluation"))
  assert last["loss"] > 0
  with open(tmp_path / "metrics.jsonl") as f:
    logged = [row for row in map(json.loads, f) if "goodput/steps_seconds" in row][-1]
  assert logged["goodput/steps_seconds"] == first["seconds"]["steps"]

  config.checkpoint.restore_step = 4  # steps 5 to 8 again: redone, not productive
  began = time.time()
  loop.train(config, str(tmp_path))
  wall += time.time() - began
  second = record(tmp_path)
  assert second["runs"] == 2 and second["seconds"]["redone_steps"] > 0
  assert second["seconds"]["steps"] == first["seconds"]["steps"]  # nothing new was trained
  assert abs(sum(second["seconds"].values()) - wall) <= 0.02 * wall, (second, wall)


@pytest.mark.long  # two cold compiles
def test_a_restart_reads_the_compiled_step_from_the_workdirs_cache(tmp_path):
  """With no cache in the environment the trainer caches under <workdir>/compilation_cache: a second start on that
  cache (its in-memory caches cleared, as a new process) reads every program from there instead of compiling."""
  session_cache = jax.config.jax_compilation_cache_dir  # the tests' (conftest.py), set aside
  hits, misses = [], []

  def listen(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
      hits.append(event)
    elif event == "/jax/compilation_cache/cache_misses":
      misses.append(event)

  monitoring.register_event_listener(listen)
  config = micro_config("mlp", steps=2)
  config.model.d_model = 48  # a program no other test compiled
  config.model.head_dim = 16
  try:
    for start in ("cold", "warm"):
      jax.config.update("jax_compilation_cache_dir", None)
      compilation_cache.reset_cache()
      jax.clear_caches()
      hits.clear()
      misses.clear()
      loop.train(config, str(tmp_path / start))
      config.train.compilation_cache_dir = str(tmp_path / "cold" / "compilation_cache")  # as a restart finds it
    assert hits and not misses, (len(hits), misses)  # every program the warm start ran came from the cache
    assert (tmp_path / "cold" / "compilation_cache").is_dir() and not (tmp_path / "warm" / "compilation_cache").exists()
  finally:
    monitoring.unregister_event_listener(listen)
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", session_cache)


def test_a_start_counts_the_time_since_a_killed_or_preempted_runs_record_as_lost(tmp_path):
  # running: killed or hung after its last record; stopped: SIGTERM. failed and finished: a person goes on.
  for status, lost in (("running", 100.0), ("stopped", 100.0), ("failed", 0.0), ("finished", 0.0)):
    earlier = dict(seconds=dict(steps=50.0, init=10.0), wall=60.0, reached=7, runs=1, status=status)
    earlier["written_at"] = time.time() - 100.0
    (tmp_path / goodput.RECORD).write_text(json.dumps(earlier))
    clock = goodput.Goodput(str(tmp_path), started=earlier["written_at"] + 100.0)
    totals = clock.totals()
    assert totals["lost"] == pytest.approx(lost, abs=1e-6) and totals["steps"] == 50.0, status
    assert sum(totals[name] for name in goodput.PARTS) == pytest.approx(totals["wall"], rel=1e-12)


@pytest.mark.parametrize(
  "damage",
  [
    '{"costs": null}',
    '{"costs": {"save_seconds": 5}}',
    '{"written_at": "yesterday"}',
    '{"seconds": [1]}',
    '{"reached": "x"}',
    '{"status": "paused"}',
    "[]",
    "{not json",
  ],
)
def test_a_damaged_record_is_set_aside_with_a_warning_and_replaced(tmp_path, damage, caplog):
  (tmp_path / goodput.RECORD).write_text(damage)
  with caplog.at_level(logging.WARNING, logger="absl"):
    clock = goodput.Goodput(str(tmp_path), started=time.time())
  assert any("goodput.json is damaged" in r.getMessage() for r in caplog.records)
  clock.save()
  assert goodput.check_record(record(tmp_path)) is None and record(tmp_path)["runs"] == 1


def test_a_failed_write_is_a_warning_not_the_end_of_the_run(tmp_path, caplog):
  clock = goodput.Goodput(str(tmp_path / "file" / "run"), started=time.time())
  (tmp_path / "file").write_text("")  # the workdir's parent is a file: every write fails
  with caplog.at_level(logging.WARNING, logger="absl"):
    clock.save()
    clock.save()
  assert [r.getMessage() for r in caplog.records].count(next(iter(caplog.records)).getMessage()) == 1
  assert "goodput.json failed" in caplog.records[0].getMessage()
