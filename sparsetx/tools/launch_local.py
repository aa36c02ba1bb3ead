"""Runs a multi-host job on this machine: N processes, each with M simulated CPU devices.

  python tools/launch_local.py --num_processes=2 --devices_per_process=2 -- \\
      --config=configs/tiny.py --workdir=/tmp/mh --config.mesh.dcn.data=-1

Everything after `--` goes to every `python -m sparsetx.train` process, which also gets
`--coordinator_address=localhost:PORT --num_processes=N --process_id=i` (so it runs exactly the
code path of a real cluster: jax.distributed, gloo collectives, per-process data shards).
`--config.mesh.dcn.data=-1` makes the processes the data-parallel DCN axis, as hosts are.

SIGTERM or Ctrl-C is forwarded to all processes (the trainer saves and exits 0); a second one kills
them. When one process fails, the others get `--grace_period` seconds to stop on their own (JAX
aborts them once it notices the dead peer), then are killed: nothing is left behind. Prints one
line per process (`launch_local: process i pid P` at start, how it ended at the end) and exits
with the first failure's code (128 + signal for a signal), or 0.
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

PREFIX = "launch_local:"


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
  return env


def exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
  if returncode < 0:
    return f"was killed by {signal.Signals(-returncode).name}"
  return f"exited with code {returncode}"


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [options] -- TRAIN_FLAGS...")
  parser.add_argument("--num_processes", type=int, default=2, help="processes to start (N)")
  parser.add_argument("--devices_per_process", type=int, default=2, help="simulated CPU devices per process (M)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port on localhost (0: a free one)")
  parser.add_argument(
    "--grace_period",
    type=float,
    default=30.0,
    help="seconds the others get to stop on their own after one process fails",
  )
  parser.add_argument("--log_dir", default=None, help="write process_<i>.log here instead of sharing this terminal")
  parser.add_argument("--module", default="sparsetx.train", help="the Python module each process runs")
  if "--" in argv:
    split = argv.index("--")
    args, forwarded = parser.parse_args(argv[:split]), argv[split + 1 :]
  else:
    args, forwarded = parser.parse_args(argv), []
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be at least 1")
  return args, forwarded


def start(args, forwarded) -> list[subprocess.Popen]:
  port = args.port or free_port()
  env = child_env(args.devices_per_process)
  processes = []
  for i in range(args.num_processes):
    command = [
      sys.executable,
      "-m",
      args.module,
      *forwarded,
      f"--coordinator_address=localhost:{port}",
      f"--num_processes={args.num_processes}",
      f"--process_id={i}",
    ]
    output = None
    if args.log_dir:
      os.makedirs(args.log_dir, exist_ok=True)
      output = open(os.path.join(args.log_dir, f"process_{i}.log"), "w")
    processes.append(subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None))
    print(f"{PREFIX} process {i} pid {processes[-1].pid}", flush=True)
  return processes


def supervise(processes: list[subprocess.Popen], grace_period: float) -> int:
  """Waits for all; forwards SIGTERM/SIGINT; after a failure, kills what is left past the grace period."""
  signals = []
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda signum, frame: signals.append(signum))
  forwarded, killed, first_failure, deadline = 0, set(), None, None
  while any(p.poll() is None for p in processes):
    if len(signals) > forwarded:
      action = signal.SIGTERM if forwarded == 0 else signal.SIGKILL
      print(f"{PREFIX} got {signal.Signals(signals[-1]).name}; sending {action.name} to all processes", flush=True)
      for p in processes:
        if p.poll() is None:
          p.send_signal(action)
      forwarded = len(signals)
    for i, p in enumerate(processes):
      if first_failure is None and p.poll() not in (None, 0):
        first_failure = i
        deadline = time.monotonic() + grace_period
        print(f"{PREFIX} process {i} {describe(p.returncode)}; the others have {grace_period:g}s to stop", flush=True)
    if deadline is not None and time.monotonic() > deadline:
      for i, p in enumerate(processes):
        if p.poll() is None:
          p.kill()
          killed.add(i)
      deadline = None
    time.sleep(0.1)
  for i, p in enumerate(processes):
    p.wait()
    how = "was killed by launch_local after the grace period" if i in killed else describe(p.returncode)
    print(f"{PREFIX} process {i} {how}", flush=True)
  return 0 if first_failure is None else exit_code(processes[first_failure].returncode)


def main(argv) -> int:
  args, forwarded = parse_args(argv)
  return supervise(start(args, forwarded), args.grace_period)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
