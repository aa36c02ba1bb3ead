"""The device chooses its kernels (train/autotune.py): every candidate measured in its own child process, checked
against XLA's values, the fastest correct one kept with the reason each other was dropped; `auto` then reads the
table, and a second process measures nothing again."""

import json
import os
import subprocess
import sys
import unittest.mock

import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO

from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.options import KernelOptions
from sparsetx.train import autotune

CALL = dict(tokens=1024, d_model=32, slots=4, rows=64, dtype="float32")


@pytest.fixture
def table(tmp_path, monkeypatch):
  """An empty table of this test's own; the child processes find the fakes (tests/ on their path) and the table."""
  monkeypatch.setenv(autotune_table.ENV, str(tmp_path / "autotune.json"))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
  return tmp_path / "autotune.json"


def test_each_candidate_is_dropped_with_its_reason_and_the_fastest_correct_is_chosen(table):
  fakes = ["SLOW", "REFUSES", "FAULTS", "WRONG", "FAST"]
  entry = autotune.tune("rows", "float32 D32 S4", CALL, KernelOptions(), [f"autotune_fakes:{f}" for f in fakes], 3)
  # both ran and matched XLA's values; SLOW sleeps 50 ms a run
  assert entry.ranking == ("autotune_fakes:FAST", "autotune_fakes:SLOW"), entry
  assert entry.dropped["autotune_fakes:REFUSES"] == "raised: it needs a Hopper GPU (a test implementation)"
  assert entry.dropped["autotune_fakes:FAULTS"].startswith("faulted: killed by SIGILL"), entry.dropped
  assert entry.dropped["autotune_fakes:WRONG"].startswith("wrong values: "), entry.dropped
  saved = json.loads(table.read_text())["entries"]
  assert list(saved) == [autotune_table.key("cpu", "rows", "float32 D32 S4")]


def test_auto_takes_the_tables_ranking_and_refuses_what_it_dropped(table):
  """On an H100 (a traced device) without a table auto takes Triton; with one it takes the ranking's first, and
  an implementation the device saw fault is refused with the recorded reason."""
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    assert registry.rows(KernelOptions(), "bfloat16 D512 S128").name == "triton"
    entry = autotune_table.Entry(("xla", "mosaic"), {"triton": "faulted: killed by SIGILL"}, {"xla": 1.0})
    autotune_table.record(h100.device_kind, "rows", "bfloat16 D512 S128", entry)
    assert registry.rows(KernelOptions(), "bfloat16 D512 S128").name == "xla"
    assert registry.rows(KernelOptions(), "bfloat16 D256 S128").name == "triton"  # another shape class
    with pytest.raises(NotImplementedError, match="triton: dropped by the measured table: faulted: killed by SIGILL"):
      registry.rows(KernelOptions(gpu_kernel="triton"), "bfloat16 D512 S128")


@pytest.mark.slow
def test_a_second_process_reads_the_table_and_measures_nothing(table):
  """sparsetx-autotune on a micro sgatlin step: the first run measures each op shape the step runs, the second
  finds them all in the table."""
  command = [
    sys.executable,
    "-m",
    "sparsetx.tools.autotune",
    "--config=configs/tiny.py",
    *MICRO_TRAIN_FLAGS,
    "--implementations=xla",
    "--rounds=1",
  ]
  first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-3000:]
  measured = [line for line in first.stdout.splitlines() if line.startswith("  rows ")]
  assert measured and all("chose xla" in line for line in measured), first.stdout
  second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, second.stderr[-3000:]
  assert f"{len(measured)} op shapes in the step, 0 to measure" in second.stdout, second.stdout
  assert not [line for line in second.stdout.splitlines() if line.startswith("  rows ")]
