"""scripts/gpu_measurements.sh tells the device call that a part failed: exit 1 and a last line naming each failed
program, so a GPU run's result cannot read as measured when a program of it fell over."""

import os
import subprocess

from conftest import REPO


def run_part(part: str, python: str, tmp_path) -> subprocess.CompletedProcess:
  env = {**os.environ, "PY": python, "OUT": str(tmp_path / "out"), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "c")}
  script = REPO / "scripts" / "gpu_measurements.sh"
  return subprocess.run(["bash", str(script), part], env=env, capture_output=True, text=True, timeout=60)


def test_a_part_whose_program_fails_exits_non_zero_naming_it(tmp_path):
  result = run_part("scale4", "false", tmp_path)  # every program the part runs exits 1
  assert result.returncode == 1, result.stderr
  assert result.stderr.splitlines()[-1] == (
    f"gpu_measurements.sh scale4: failed: scale4_triton (rc=1); scale4_mosaic (rc=1) (logs in {tmp_path / 'out'})"
  )
  assert (tmp_path / "out" / "scale4_triton.log").read_text().endswith("rc=1\n")


def test_a_part_whose_programs_all_succeed_exits_zero(tmp_path):
  result = run_part("scale4", "true", tmp_path)
  assert result.returncode == 0 and "failed" not in result.stderr, result.stderr
