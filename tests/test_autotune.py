"""The device chooses its kernels (train/autotune.py): every candidate measured in its own child process, checked
against XLA's values, the fastest correct one kept with the reason each other was dropped; `auto` then reads the
table, and a second process measures nothing again."""

import json
import os
import subprocess
import sys
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO_TRAIN_FLAGS, REPO
from kernel_cases import gather_case

from sparsetx.kernels import autotune_table, registry
from sparsetx.kernels.backend import ModuleRows
from sparsetx.kernels.device import TracedDevice
from sparsetx.kernels.gated_gather import gated_gather
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
  fakes = ["SLOW", "REFUSES", "FAULTS", "WRONG", "FAST", "FAST@block_tokens=16"]
  entry = autotune.tune("rows", "float32 D32 S4", CALL, KernelOptions(), [f"autotune_fakes:{f}" for f in fakes], 3)
  # three ran and matched XLA's values (FAST at a tiling too, as fast: either may lead); SLOW sleeps 50 ms a run
  assert set(entry.ranking[:2]) == {"autotune_fakes:FAST", "autotune_fakes:FAST@block_tokens=16"}, entry
  assert entry.ranking[2:] == ("autotune_fakes:SLOW",), entry
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


def test_a_ranked_tiling_runs_where_the_table_put_it(table):
  """A table whose first choice is Triton at a tiling makes `auto` on an H100 take Triton with those knobs (the
  config's other knobs kept); the same implementation untiled comes next."""
  h100 = TracedDevice("gpu", "NVIDIA H100 80GB HBM3", 132)
  entry = autotune_table.Entry(("triton@block_d=256,block_tokens=16", "triton"), {}, {})
  with unittest.mock.patch.object(registry, "target", lambda: h100):
    autotune_table.record(h100.device_kind, "rows", "bfloat16 D512 S128", entry)
    chosen = registry.rows(KernelOptions(stages=2), "bfloat16 D512 S128")
  assert chosen.name == "triton@block_d=256,block_tokens=16" and chosen.base is registry.by_name("rows", "triton")
  assert chosen.tiled(KernelOptions(stages=2)) == KernelOptions(stages=2, block_tokens=16, block_d=256)


def test_a_tiling_reaches_every_kernel_of_both_passes():
  """backend.Tiled hands its knobs to each kernel the forms compose (row_dots, row_accumulate, segment_sums, forward
  and backward), and the values are the implementation's own."""
  seen = []

  class Recording(ModuleRows):  # XLA's kernels composed as the accelerators compose theirs
    def row_dots(self, *args):
      seen.append(("row_dots", args[-1].block_tokens, args[-1].block_d))
      return super().row_dots(*args)

    def row_accumulate(self, *args):
      seen.append(("row_accumulate", args[-1].block_tokens, args[-1].block_d))
      return super().row_accumulate(*args)

    def segment_sums(self, values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
      seen.append(("segment_sums", options.block_tokens, options.block_d))
      return super().segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums)

  plain = Recording("recording", "sparsetx.kernels.xla_rows", None)
  tiled = registry.at_tiling("rows", plain, "block_tokens=16,block_d=256")
  x, w_in, w_out, rows, gates, bias = gather_case(0, 1, 6, 2, 2, 3, 32)

  def grads(implementation):
    fn = lambda *a: gated_gather(*a[:3], rows, a[3], options=KernelOptions("pallas"), implementation=implementation)  # noqa: E731
    return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2, 3))(x, w_in, w_out, gates)

  want = grads(plain)
  seen.clear()
  got = grads(tiled)
  assert {name for name, *_ in seen} == {"row_dots", "row_accumulate", "segment_sums"}, seen
  assert all((tokens, d) == (16, 256) for _, tokens, d in seen), seen
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def test_a_tiling_is_named_by_knob_and_integer():
  with pytest.raises(ValueError, match="tiling 'block_tokens=x' is not knob=integer"):
    registry.by_name("rows", "triton@block_tokens=x")
  with pytest.raises(ValueError, match=r"a tiling sets .* not \['warps'\]"):
    registry.by_name("rows", "triton@warps=4")
  with pytest.raises(ValueError, match="only the row kernels take a tiling"):
    registry.by_name("grouped_matmul", "triton@block_d=64")
  assert "triton@block_tokens=16" in autotune.specs_for("rows", tilings=True)
  assert not any("@" in spec for spec in autotune.specs_for("rows"))


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
