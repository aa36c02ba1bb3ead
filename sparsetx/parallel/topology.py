"""Devices of a machine this one does not have, for compiling its programs with its real compiler.

  TPU  a topology name libtpu knows: `v5p:2x2x1` (4 chips), `v6e:2x2`, `v5p:4x4x2` (32 chips over 8 hosts), ...
  GPU  `h100:SxHxG` or `a100:SxHxG`: S slices x H hosts x G GPUs, described by the target files in gpu_targets/
       (public device figures), compiled by XLA's GPU compiler from the CUDA plugin, with no GPU and no driver.

More: docs/modules.md, sparsetx/parallel/topology.py.
"""

import contextlib
import importlib.resources
import importlib.util
import os
import re

from sparsetx.config import ConfigError

GPU_TARGETS = ("h100", "h200", "a100")
_GPU_RE = re.compile(r"^(?P<chip>[a-z]\d+):(?P<shape>\d+x\d+x\d+)$")
_TPU_RE = re.compile(r"^v\d+\w*:\d+(x\d+)*$")
GPU_COMPILE_NOTE = "GPU compiled with no device: XLA's default tilings (no autotuning) and XLA's sort in place of CUB's"
# libtpu's start-up asks the cloud metadata server what it runs on, and prints warnings when there is none; a
# topology needs none of that.
_LIBTPU_QUIET = {
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # test workers each load it; without this the second one fails on a lockfile
  "TPU_SKIP_MDS_QUERY": "1",
  "TPU_ACCELERATOR_TYPE": "v5p-8",
  "TPU_WORKER_ID": "0",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_STDERR_LOG_LEVEL": "3",
  "TPU_MIN_LOG_LEVEL": "3",
}


def is_gpu(name: str) -> bool:
  return bool(_GPU_RE.match(name))


def gpu_target_config(chip: str) -> str:
  """The GpuTargetConfigProto text of a shipped GPU target (gpu_targets/CHIP.txtpb)."""
  if chip not in GPU_TARGETS:
    raise ConfigError(f"GPU target {chip!r} is not described; use one of {', '.join(GPU_TARGETS)}.")
  return importlib.resources.files("sparsetx.parallel").joinpath(f"gpu_targets/{chip}.txtpb").read_text()


def devices(name: str) -> list:
  """The devices of a topology name (module docstring), in the topology's order; one ConfigError line for a name
  neither compiler knows or a compiler that is not installed."""
  from jax.experimental import topologies

  gpu = _GPU_RE.match(name)
  if gpu:
    config = gpu_target_config(gpu["chip"])
    _require("jax_cuda12_plugin", "the CUDA plugin", "jax[cuda12]")
    return list(topologies.get_topology_desc(platform="cuda", target_config=config, topology=gpu["shape"]).devices)
  if not _TPU_RE.match(name):
    raise ConfigError(
      f"topology {name!r} is neither a TPU topology (v5p:2x2x1, v6e:2x2, v5p:4x4x2) nor a GPU one "
      f"({', '.join(f'{c}:1x1x8' for c in GPU_TARGETS)}: slices x hosts x GPUs)."
    )
  _require("libtpu", "libtpu", "jax[tpu]")
  try:
    with _environment(_LIBTPU_QUIET):  # only while libtpu starts: a child process must not think it is on a TPU VM
      return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
  except Exception as error:  # libtpu's own words for a name it does not know
    raise ConfigError(
      f"libtpu knows no TPU topology {name!r} ({_first_line(error)}); try v5p:2x2x1 or v6e:2x2."
    ) from None


@contextlib.contextmanager
def _environment(values: dict):
  """os.environ with `values` set where unset, restored on exit."""
  added = {key: value for key, value in values.items() if key not in os.environ}
  os.environ.update(added)
  try:
    yield
  finally:
    for key in added:
      os.environ.pop(key, None)


def _require(module: str, what: str, extra: str) -> None:
  if importlib.util.find_spec(module) is None:
    raise ConfigError(f"compiling for this topology needs {what}: pip install '{extra}' (or the test extras).")


def _first_line(error: BaseException) -> str:
  return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
