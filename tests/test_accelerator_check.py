"""The accelerator acceptance script runs its CPU form (`--small`) and its kernel checks can fail."""

import subprocess
import sys
import types

from conftest import REPO

from sparsetx.kernels import pallas_gpu
from sparsetx.kernels.options import KernelOptions
from sparsetx.tools import accelerator_check


def test_small_form_prints_one_table_of_passing_checks_and_every_part():
  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.accelerator_check", "--small"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  lines = result.stdout.splitlines()
  kernel_rows = [line for line in lines if line.startswith("kernels ")]
  assert len(kernel_rows) == 4 and all(line.rstrip().endswith("ok") for line in kernel_rows), kernel_rows
  assert sum(line.startswith("kernel bench ") and "GB/s" in line for line in lines) == 7
  trained = [line.split()[2] for line in lines if line.startswith("train step ")]
  assert trained == accelerator_check.TRAIN_TYPES


def test_a_wrong_kernel_fails_its_check(monkeypatch):
  """A row_dots 1% off fails its check (its bound is about D float32 roundings); the correct kernels pass."""
  wrong = types.SimpleNamespace(
    row_dots=lambda *a: pallas_gpu.row_dots(*a) * 1.01,
    row_accumulate=pallas_gpu.row_accumulate,
    segment_sums=pallas_gpu.segment_sums,
  )
  monkeypatch.setattr(accelerator_check.platform, "kernel_backend", lambda options: wrong)
  monkeypatch.setattr(accelerator_check, "_op_versus_xla", lambda *a: ("skipped", None))
  rows = accelerator_check.check_kernels("triton", KernelOptions("pallas", interpret=True), small=True)
  verdicts = {what: verdict for _, what, _, verdict in rows}
  assert verdicts == {
    "triton row_dots": False,
    "triton row_accumulate": True,
    "triton segment_sums": True,
    "triton gated gather + grads": None,
  }
