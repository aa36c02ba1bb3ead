"""Runs a multi-host job on this machine: N processes, each with M simulated CPU devices.

  python -m sparsetx.tools.launch_local --num_processes=2 --devices_per_process=2 -- \
      --config=configs/tiny.py --workdir=/tmp/mh --config.mesh.dcn.data=-1

More: docs/modules.md, sparsetx/tools/launch_local.py.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags, logging  # noqa: F401  (logging defines --log_dir)

from sparsetx import cli
from sparsetx.config import ConfigError

PREFIX = "launch_local:"
# Gloo's line per pair of processes as the CPU collectives connect (N * (N - 1) of them, all alike): not relayed.
GLOO_CONNECTED = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    num_processes=flags.DEFINE_integer("num_processes", 2, "Processes to start (N)."),
    devices_per_process=flags.DEFINE_integer("devices_per_process", 2, "Simulated CPU devices per process (M)."),
    port=flags.DEFINE_integer("port", 0, "Coordinator port on localhost (0: a free one)."),
    grace_period=flags.DEFINE_float(
      "grace_period", 30.0, "Seconds the others get to stop on their own after one process fails."
    ),
    # --log_dir (write process_<i>.log there instead of sharing this terminal) is absl.logging's own flag, read
    # here: the launcher itself logs nothing to files.
    module=flags.DEFINE_string("module", "sparsetx.train", "The Python module each process runs."),
  )


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def child_env(devices: int) -> dict:
  """This environment with `devices` simulated CPU devices (any other device count flag replaced)."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"  # each line as it is printed, not a buffer at exit
  return env


def exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
  if returncode < 0:
    return f"was killed by {signal.Signals(-returncode).name}"
  return f"exited with code {returncode}"


def start(
  forwarded: list[str], *, num_processes: int, devices_per_process: int, port: int, module: str
) -> list[subprocess.Popen]:
  """`num_processes` processes of `python -m module *forwarded`, joined at localhost:`port` (0: a free one)."""
  port = port or free_port()
  env = child_env(devices_per_process)
  processes = []
  where = f"in {flags.FLAGS.log_dir}/process_<i>.log" if flags.FLAGS.log_dir else "here, each line prefixed [i]"
  say(f"{PREFIX} {num_processes} processes x {devices_per_process} CPU devices; their output {where}")
  for i in range(num_processes):
    command = [
      sys.executable,
      "-m",
      module,
      *forwarded,
      f"--coordinator_address=localhost:{port}",
      f"--num_processes={num_processes}",
      f"--process_id={i}",
    ]
    if flags.FLAGS.log_dir:
      os.makedirs(flags.FLAGS.log_dir, exist_ok=True)
      output = open(os.path.join(flags.FLAGS.log_dir, f"process_{i}.log"), "w")
    else:
      output = subprocess.PIPE
    process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    if process.stdout is not None:
      process.relay = threading.Thread(target=relay, args=(process.stdout, f"[{i}] "), daemon=True)
      process.relay.start()
    processes.append(process)
    say(f"{PREFIX} process {i} pid {process.pid}")
  return processes


_print_lock = threading.Lock()


def say(line: str) -> None:
  with _print_lock:
    print(line, flush=True)


def relay(stream, prefix: str) -> None:
  """Copies a process's output to this stdout line by line, each line prefixed (whole lines: no interleaving)."""
  for line in iter(stream.readline, b""):
    if GLOO_CONNECTED.match(line):
      continue
    with _print_lock:
      sys.stdout.buffer.write(prefix.encode() + line if line.endswith(b"\n") else prefix.encode() + line + b"\n")
      sys.stdout.flush()
  stream.close()


def supervise(processes: list[subprocess.Popen], grace_period: float) -> int:
  """Waits for all; forwards SIGTERM/SIGINT; after a failure, kills what is left past the grace period."""
  signals = []
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: signals.append(signum))
  forwarded, killed, first_failure, deadline = 0, set(), None, None
  while any(p.poll() is None for p in processes):
    if len(signals) > forwarded:
      action = signal.SIGTERM if forwarded == 0 else signal.SIGKILL
      say(f"{PREFIX} got {signal.Signals(signals[-1]).name}; sending {action.name} to all processes")
      for p in processes:
        if p.poll() is None:
          p.send_signal(action)
      forwarded = len(signals)
    for i, p in enumerate(processes):
      if first_failure is None and p.poll() not in (None, 0):
        first_failure = i
        deadline = time.monotonic() + grace_period
        say(f"{PREFIX} process {i} {describe(p.returncode)}; the others have {grace_period:g}s to stop")
    if deadline is not None and time.monotonic() > deadline:
      for i, p in enumerate(processes):
        if p.poll() is None:
          p.kill()
          killed.add(i)
      deadline = None
    time.sleep(0.1)
  if first_failure is None:  # all ended between two polls (a watchdog ends every process at once)
    first_failure = next((i for i, p in enumerate(processes) if p.returncode != 0), None)
  for p in processes:
    p.wait()
    if getattr(p, "relay", None) is not None:
      p.relay.join(timeout=10)  # its last lines before how it ended
  for i, p in enumerate(processes):
    how = "was killed by launch_local after the grace period" if i in killed else describe(p.returncode)
    say(f"{PREFIX} process {i} {how}")
  return 0 if first_failure is None else exit_code(processes[first_failure].returncode)


def absl_main(argv, holders: dict) -> int:
  """argv: the program name, then what followed `--` (absl stops parsing its own flags there)."""
  args = cli.flag_values(holders)
  if args.num_processes < 1 or args.devices_per_process < 1:
    cli.fail(ConfigError("--num_processes and --devices_per_process must be at least 1."))
  processes = start(
    argv[1:],
    num_processes=args.num_processes,
    devices_per_process=args.devices_per_process,
    port=args.port,
    module=args.module,
  )
  return supervise(processes, args.grace_period)


def main():
  """The `sparsetx-launch-local` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders), forwards_after_dashdash=True)


if __name__ == "__main__":
  main()
