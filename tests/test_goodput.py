"""Goodput (sparsetx/train/goodput.py): the trainer's parts add up to the wall time measured around it, a resume from
an earlier step counts the steps it repeats as redone, and the totals add up over the runs of one workdir."""

import json
import time

from test_train import micro_config

from sparsetx.train import goodput, loop


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
