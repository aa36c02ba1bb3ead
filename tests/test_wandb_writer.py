"""Weights & Biases (sparsetx/train/tracking/wandb_writer.py), offline: the run's .wandb files, read back with wandb's own
reader, hold every scalar metrics.jsonl holds, and a resumed run continues the same W&B run."""

import importlib.util
import json

import pytest
from test_train import micro_config
from wandb.proto import wandb_internal_pb2
from wandb.sdk.internal import datastore

from sparsetx import config as config_lib
from sparsetx.train.run import loop
from sparsetx.train.tracking import wandb_writer


def wandb_records(workdir) -> tuple[set, dict]:
  """(the run ids, {step: {metric: value}}) of every offline run file under the workdir."""
  ids, history = set(), {}
  for path in sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb")):
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    while (data := store.scan_data()) is not None:
      record = wandb_internal_pb2.Record()
      record.ParseFromString(data)
      kind = record.WhichOneof("record_type")
      if kind == "run":
        ids.add(record.run.run_id)
      elif kind == "history":
        row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        history.setdefault(row.pop("_step"), {}).update(row)
  return ids, history


def test_an_offline_run_holds_the_logged_scalars_and_a_resume_continues_it(tmp_path):
  config = micro_config("mlp", steps=4, log_every=2)
  config.checkpoint.update(every=2, every_minutes=0.0)
  config.metrics.wandb.update(project="sparsetx-test", mode="offline")
  loop.train(config, str(tmp_path))
  config.train.update(steps=6, accept_schedule_change=True)  # a restart that goes on from step 4
  loop.train(config, str(tmp_path))

  ids, history = wandb_records(tmp_path)
  assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2
  assert ids == {(tmp_path / wandb_writer.RUN_ID).read_text().strip()}  # both starts log to one W&B run
  with open(tmp_path / "metrics.jsonl") as f:
    logged = {}
    for row in map(json.loads, f):
      logged.setdefault(row.pop("step"), {}).update(row)
  assert {2, 4, 6} <= set(logged)
  for step, row in logged.items():
    assert {k: history[step][k] for k in row} == row, step


def test_a_project_without_the_wandb_package_is_refused_with_how_to_install_it(monkeypatch):
  config = micro_config("mlp")
  config.metrics.wandb.project = "sparsetx-test"
  found = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
  with pytest.raises(config_lib.ConfigError, match=r"needs the wandb package.*pip install 'sparsetx\[wandb\]'"):
    config_lib.validate(config)
  config.metrics.wandb.mode = "disabled"
  config_lib.validate(config)
