"""Multi-host start-up: who is the coordinator, how many processes, which one is this.

The same `python -m sparsetx.train ...` runs under SLURM, on TPU VM pods, on Kubernetes (JobSet)
and on one machine. `detect(environ, ...)` is a pure function of the environment and the flags
(unit-tested on recorded environments); `initialize(spec)` calls `jax.distributed.initialize`
with a timeout and turns a peer that never shows up into one sentence naming the coordinator.

More: docs/modules.md, sparsetx/parallel/distributed.py.
"""

import dataclasses
import glob
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence

from sparsetx.config import ConfigError

SINGLE, FLAGS, SLURM, KUBERNETES, TPU = "single process", "flags", "slurm", "kubernetes", "tpu"
K8S_COORDINATOR_PORT = 8476
# SLURM: the coordinator port is derived from the job id so that concurrent jobs sharing a node
# differ; the range is the top 4096 ports.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 61440, 4096


class DistributedError(RuntimeError):
  """Multi-host start-up failed; the message is one sentence naming the coordinator or the flag."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """Where the values for `jax.distributed.initialize` came from, and the values (None: JAX decides)."""

  source: str
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None

  @property
  def multi_process(self) -> bool:
    return self.source != SINGLE


def first_host(nodelist: str) -> str:
  """The first host of a SLURM hostlist: 'gpu-[003-004,010],login1' -> 'gpu-003'."""
  first, depth = "", 0
  for char in nodelist:  # the first top-level comma ends the first item
    depth += (char == "[") - (char == "]")
    if char == "," and depth == 0:
      break
    first += char
  # each bracket expression contributes its first value, zero padding kept ('[003-004]' -> '003')
  return re.sub(r"\[([^,\]-]+)[^\]]*\]", r"\1", first.strip())


def _slurm(env: Mapping[str, str]) -> Spec:
  nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
  port = SLURM_PORT_BASE + int(env["SLURM_JOB_ID"]) % SLURM_PORT_SPAN
  count = int(env["SLURM_NTASKS"])
  nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or count)
  visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
  local = None
  if count > nodes and len(visible) != 1 and "SLURM_LOCALID" in env:
    local = (int(env["SLURM_LOCALID"]),)
  return Spec(SLURM, f"{first_host(nodelist)}:{port}", count, int(env["SLURM_PROCID"]), local)


def _kubernetes(env: Mapping[str, str]) -> Spec:
  per_job = int(env.get("PODS_PER_JOB", "1"))
  name, job = env["JOBSET_NAME"], env["REPLICATED_JOB_NAME"]
  coordinator = f"{name}-{job}-0-0.{name}:{K8S_COORDINATOR_PORT}"
  process_id = int(env.get("JOB_INDEX", "0")) * per_job + int(env.get("JOB_COMPLETION_INDEX", "0"))
  count = int(env["JOBSET_REPLICAS"]) * per_job if "JOBSET_REPLICAS" in env else None
  return Spec(KUBERNETES, coordinator, count, process_id)


def tpu_vm_present() -> bool:
  """A Cloud TPU VM: libtpu is installed and the chips appear as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5+)."""
  chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
  return bool(chips) and importlib.util.find_spec("libtpu") is not None


def detect(
  env: Mapping[str, str],
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids: Sequence[int] | None = None,
  tpu_present: bool = False,
) -> Spec:
  """The multi-host spec for this environment; any flag given overrides the detected value.

  Raises ConfigError when the result is incomplete or inconsistent (a usage error, exit code 2).
  """
  flags = dict(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    local_device_ids=tuple(local_device_ids) if local_device_ids else None,
  )
  if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and ("SLURM_STEP_NODELIST" in env or "SLURM_JOB_NODELIST" in env):
    detected = _slurm(env)
  elif "JOBSET_NAME" in env and "REPLICATED_JOB_NAME" in env:
    detected = _kubernetes(env)
  elif tpu_present or "TPU_WORKER_HOSTNAMES" in env or "MEGASCALE_COORDINATOR_ADDRESS" in env:
    detected = Spec(TPU)  # jax.distributed.initialize() reads the TPU metadata itself
  elif any(v is not None for v in flags.values()):
    detected = Spec(FLAGS)
  else:
    return Spec(SINGLE)
  overrides = {k: v for k, v in flags.items() if v is not None}
  spec = dataclasses.replace(detected, **overrides)
  if detected.source != FLAGS and overrides:
    joining = ("coordinator_address", "num_processes", "process_id")
    spec = dataclasses.replace(
      spec, source=FLAGS if all(k in overrides for k in joining) else f"{detected.source} + flags"
    )
  _check(spec)
  return spec


def _check(spec: Spec) -> None:
  if spec.source == TPU:
    return
  missing = [
    f"--{name}" for name in ("coordinator_address", "num_processes", "process_id") if getattr(spec, name) is None
  ]
  if missing:
    raise ConfigError(
      f"multi-host start-up ({spec.source}) is missing {', '.join(missing)}; give all of --coordinator_address, "
      "--num_processes and --process_id (or run under SLURM, a JobSet or a TPU VM pod, which set them)."
    )
  if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
    raise ConfigError(
      f"--process_id={spec.process_id} must be in [0, --num_processes={spec.num_processes}); "
      "number the processes 0, 1, ..., num_processes - 1."
    )
  if ":" not in spec.coordinator_address:
    raise ConfigError(
      f"--coordinator_address={spec.coordinator_address} has no port; give HOST:PORT, e.g. "
      f"{spec.coordinator_address}:{K8S_COORDINATOR_PORT}."
    )


def initialize(spec: Spec, *, timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> None:
  """Joins the multi-host run (no-op for a single process); a failure to join ends it with one line.

  `timeout_s` bounds the wait for all processes to connect. JAX itself aborts the process from C++
  when its own connect deadline passes (no Python exception to catch), so a watchdog thread ends
  the process first, printing which coordinator it waited for, with exit code 4. Errors JAX does
  raise become DistributedError. `heartbeat_timeout_s` is how long a silent peer counts as alive
  before JAX stops the others (a killed process never hangs the rest).
  """
  if not spec.multi_process:
    return
  import jax  # here, not at import time: the flags are parsed before JAX starts

  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
  where = spec.coordinator_address or "the TPU coordinator"
  who = f"process {spec.process_id} of {spec.num_processes}" if spec.num_processes else "this TPU worker"
  advice = (
    f"Check that all processes started with the same --num_processes, that {where} is reachable from this "
    "host, and that process 0 runs there."
  )

  def give_up():
    print(
      f"error: {who} could not join the run at coordinator {where} within {timeout_s}s ({spec.source}): "
      f"not every process connected. {advice}",
      file=sys.stderr,
      flush=True,
    )
    os._exit(4)

  watchdog = threading.Timer(timeout_s, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
      coordinator_address=spec.coordinator_address,
      num_processes=spec.num_processes,
      process_id=spec.process_id,
      local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
      initialization_timeout=timeout_s + 60,  # the watchdog's message comes first
      heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    jax.devices()  # the backend exchanges device topologies with every peer: surface failures here
  except Exception as error:  # XlaRuntimeError, RuntimeError, ValueError: all mean "could not join"
    reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    raise DistributedError(
      f"{who} could not join the run at coordinator {where} ({spec.source}): {reason}. {advice}"
    ) from None
  finally:
    watchdog.cancel()


def shutdown() -> None:
  """Leaves the run after a clean finish: waits (bounded by JAX) until every process got here, so
  process 0's coordinator outlives the others' last collective."""
  import jax

  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
