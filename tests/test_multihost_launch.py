"""sparsetx.tools.launch_local supervises its processes; a trainer whose peer never connects says so and exits."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import REPO

# Stands in for the trainer: records what it was started with, then behaves as argv[...] says.
FAKE = r"""
import json, os, signal, sys, time
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
i, out = int(flags["process_id"]), flags["out"]
def on_term(signum, frame):
  open(f"{out}/term_{i}", "w").close()
  sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if flags["mode"] == "stubborn" and i == 0 else on_term)
print(f"stdout of {i}", flush=True)  # before the started file the test waits for
print(f"stderr of {i}", file=sys.stderr, flush=True)
json.dump(dict(flags=flags, xla_flags=os.environ["XLA_FLAGS"], platforms=os.environ["JAX_PLATFORMS"]),
          open(f"{out}/started_{i}.json", "w"))
if flags["mode"] == "stubborn" and i == 1:
  time.sleep(0.5)
  sys.exit(3)
time.sleep(60)
"""


def launch(tmp_path, mode, *options):
  (tmp_path / "fake_trainer.py").write_text(FAKE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
  command = [
    sys.executable,
    "-m",
    "sparsetx.tools.launch_local",
    "--num_processes=2",
    "--devices_per_process=3",
    "--module=fake_trainer",
    *options,
    "--",
    f"--out={tmp_path}",
    f"--mode={mode}",
  ]
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(paths, process, timeout=30):
  deadline = time.time() + timeout
  while not all(p.exists() for p in paths):
    assert process.poll() is None and time.time() < deadline, process.communicate()[0]
    time.sleep(0.05)


def pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_processes_get_the_distributed_flags_and_devices_and_sigterm_is_forwarded(tmp_path):
  launcher = launch(tmp_path, "obedient")
  wait_for([tmp_path / "started_0.json", tmp_path / "started_1.json"], launcher)
  launcher.send_signal(signal.SIGTERM)
  output = launcher.communicate(timeout=30)[0]
  assert launcher.returncode == 0, output
  assert (tmp_path / "term_0").exists() and (tmp_path / "term_1").exists()
  started = [json.loads((tmp_path / f"started_{i}.json").read_text()) for i in range(2)]
  assert [s["flags"]["process_id"] for s in started] == ["0", "1"]
  assert {s["flags"]["num_processes"] for s in started} == {"2"}
  coordinators = {s["flags"]["coordinator_address"] for s in started}
  assert len(coordinators) == 1 and coordinators.pop().startswith("localhost:")
  assert all("--xla_force_host_platform_device_count=3" in s["xla_flags"].split() for s in started)
  assert all(s["platforms"] == "cpu" for s in started)
  lines = output.splitlines()  # each process's lines, stdout and stderr, prefixed with its index
  assert {f"[{i}] {stream} of {i}" for i in range(2) for stream in ("stdout", "stderr")} <= set(lines), output
  assert lines[0].startswith("launch_local: 2 processes x 3 CPU devices; their output here, each line prefixed")


def test_one_failed_process_stops_the_others(tmp_path):
  start = time.time()
  launcher = launch(tmp_path, "stubborn", "--grace_period=1")  # process 0 ignores SIGTERM: it must be killed
  output = launcher.communicate(timeout=30)[0]
  assert launcher.returncode == 3, output
  assert "process 1 exited with code 3" in output
  assert "process 0 was killed by launch_local after the grace period" in output
  pids = [int(line.split()[-1]) for line in output.splitlines() if " pid " in line]
  assert len(pids) == 2 and not any(pid_alive(pid) for pid in pids)
  assert time.time() - start < 20


def test_a_peer_that_never_connects_ends_the_trainer_with_the_coordinator_named(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  command = [
    sys.executable,
    "-m",
    "sparsetx.train",
    f"--workdir={tmp_path}",
    f"--coordinator_address=localhost:{port}",
    "--num_processes=2",
    "--process_id=0",
    "--distributed_timeout=2",
  ]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 4, result.stderr[-3000:]
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith(f"error: process 0 of 2 could not join the run at coordinator localhost:{port} within 2s")
  )


def test_processes_that_fail_between_two_polls_give_the_first_ones_code():
  """A watchdog ends every process at once: all may have exited before the supervisor's next look."""
  from sparsetx.tools import launch_local

  done = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"]) for code in (0, 6, 7)]
  for process in done:
    process.wait()
  handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  try:
    assert launch_local.supervise(done, grace_period=1) == 6
  finally:
    for signum, handler in handlers.items():  # supervise forwards these to its processes; this one is pytest's
      signal.signal(signum, handler)
