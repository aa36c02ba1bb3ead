"""The accelerator acceptance script runs its CPU form (`--small`) and its kernel checks can fail."""

import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import REPO

from sparsetx.kernels import registry
from sparsetx.kernels.options import KernelOptions
from sparsetx.kernels.rows import triton
from sparsetx.kernels.rows.records import Rows
from sparsetx.tools import accelerator_check


@pytest.mark.long  # a system case of half a minute or more: make test-long
@pytest.mark.slow
def test_small_form_prints_one_table_of_passing_checks_and_every_part():
  result = subprocess.run(
    # Two sections in child processes, as a GPU runs its Mosaic ones: their rows come back into the one table.
    [sys.executable, "-m", "sparsetx.tools.accelerator_check", "--small", "--isolate=moe bench,train fff"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  lines = result.stdout.splitlines()
  kernel_rows = [line for line in lines if line.startswith("kernels ")]
  # Off a GPU: Triton's kernels (interpreted) and XLA's row-order dots, 4 rows each, and Triton's grouped matmul.
  assert len(kernel_rows) == 9 and all(line.rstrip().endswith("ok") for line in kernel_rows), kernel_rows
  assert sum(" xla_row_order " in line for line in kernel_rows) == 4, kernel_rows
  assert any("grouped matmul + grads" in line for line in kernel_rows), kernel_rows
  assert sum(line.startswith("kernel bench ") and "GB/s" in line for line in lines) == 2 * 7
  assert sum(line.startswith("moe bench ") and "faster than rollout" in line for line in lines) == 1
  trained = [line.split()[2] for line in lines if line.startswith("train step ")]
  assert trained == accelerator_check.TRAIN_TYPES


def use_for_pallas(monkeypatch, implementation):
  """The registry gives `implementation` for its name (the check asks for each backend by name); the XLA path the
  kernels are checked against is the real one."""
  real = registry.by_name

  def by_name(op, name):
    return implementation if (op, name) == ("rows", implementation.name) else real(op, name)

  monkeypatch.setattr(registry, "by_name", by_name)


def test_a_wrong_kernel_fails_its_check(monkeypatch):
  """A row_dots 1% off fails its check (its bound is about D float32 roundings) and the whole op's against the XLA
  path, which runs for real; the correct kernels pass."""

  class OnePercentOff(Rows):
    def row_dots(self, *args):
      return super().row_dots(*args) * 1.01

  use_for_pallas(monkeypatch, OnePercentOff("triton", "gpu", module=triton))
  rows = accelerator_check.check_kernels("triton", KernelOptions("triton", interpret=True), small=True)
  verdicts = {what: verdict for _, what, _, verdict in rows}
  assert verdicts == {
    "triton row_dots": False,
    "triton row_accumulate": True,
    "triton segment_sums": True,
    "triton gated gather + grads": False,
  }


def test_a_wrong_grouped_matmul_fails_its_check(monkeypatch):
  """A grouped matmul whose output is 1% off fails (its bound is float32 sums plus one bf16 rounding, 0.4%)."""
  real = accelerator_check.grouped_matmul
  options = KernelOptions("triton", interpret=True)
  assert accelerator_check.check_grouped("triton", options, small=True)[0][-1]
  monkeypatch.setattr(accelerator_check, "grouped_matmul", lambda *a: real(*a) * 1.01)
  assert not accelerator_check.check_grouped("triton", options, small=True)[0][-1]


def test_each_element_is_bounded_by_its_own_summation_length():
  """An error twice a 1-term sum's bound fails there, though a 40-term neighbour's bound would admit it."""
  want, scale = np.ones(2), np.ones(2)
  bound_1 = accelerator_check.REASSOCIATION * 1 * accelerator_check.U32 + accelerator_check.U32
  got = want + np.array([2 * bound_1, 0.0])
  assert not accelerator_check.within_bound(got, want, scale, np.array([1, 40]))[1]
  assert accelerator_check.within_bound(got, want, scale, 40)[1]


def test_a_kernel_that_raises_is_one_failed_row_and_the_others_run(monkeypatch):
  """A backend whose row_dots does not lower (as Mosaic GPU's did under jax 0.11.2) gives its rows the error's first
  line and FAILED; the other kernels' rows still run and pass."""

  def refused(*args):
    raise NotImplementedError("Implicit broadcast not implemented with warpgroup semantics\n(more lines)")

  class Refused(Rows):
    def row_dots(self, *args):
      refused()

  use_for_pallas(monkeypatch, Refused("mosaic", "gpu", module=triton))
  rows = accelerator_check.check_kernels("mosaic", KernelOptions("triton", interpret=True), small=True)
  by_kernel = {what: (value, verdict) for _, what, value, verdict in rows}
  assert by_kernel["mosaic row_dots"] == (
    "NotImplementedError: Implicit broadcast not implemented with warpgroup semantics",
    False,
  )
  assert by_kernel["mosaic row_accumulate"][1] and by_kernel["mosaic segment_sums"][1]
  assert by_kernel["mosaic gated gather + grads"][1] is False  # the whole op calls row_dots too
  assert "FAILED" in accelerator_check.format_table(rows)


def test_a_child_that_dies_is_one_failed_row_and_the_other_sections_still_run(monkeypatch):
  """An isolated section whose process is killed by SIGILL (a Mosaic GPU kernel's illegal instruction) is one FAILED
  row naming the signal and its last stderr line; the section after it runs in this process and passes."""
  dies = "import os, signal, sys; print('illegal instruction in segment_sums', file=sys.stderr); "
  dies += "os.kill(os.getpid(), signal.SIGILL)"
  monkeypatch.setattr(accelerator_check, "child_command", lambda section, small: [sys.executable, "-c", dies])
  monkeypatch.setattr(accelerator_check, "section_names", lambda small: ["backend mosaic", "train mlp"])
  rows = accelerator_check.all_rows(small=True, isolate=["backend mosaic"])
  assert rows[0] == (
    "kernels",
    "backend mosaic",
    "child process killed by SIGILL: illegal instruction in segment_sums",
    False,
  )
  assert [row[0] for row in rows[1:]] == ["train step"] and "tokens/s" in rows[1][2], rows


def test_triton_runs_first_and_mosaic_gpu_sections_are_isolated_on_a_hopper_gpu(monkeypatch):
  """On an H100 every section that may run Mosaic GPU under any table runs in a child: its backend's, MoE's (its
  grouped matmul is Mosaic GPU's by default), and the sparse row types' train steps (a table may rank it first);
  off a GPU nothing is isolated."""
  device = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  monkeypatch.setattr(accelerator_check, "target", lambda: device)
  monkeypatch.setattr(registry, "target", lambda: device)
  names = accelerator_check.section_names(small=False)
  assert names[:2] == ["backend triton", "backend mosaic"]
  isolated = [name for name in names if accelerator_check.may_run_mosaic_gpu(name)]
  assert isolated == ["backend mosaic", "moe bench", "train sgatlin", "train fff", "train moe"]
  device.platform, device.device_kind = "cpu", "cpu"
  assert not any(accelerator_check.may_run_mosaic_gpu(name) for name in accelerator_check.section_names(True))
