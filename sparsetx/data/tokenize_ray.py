"""The tokenize job's shards as a Ray Data pipeline: a local runner here, a Ray cluster given its address.

Ray, not Beam: Levanter builds its token caches with it, it installs here without moving any pinned library
(Beam would move protobuf and pyarrow under TensorFlow and orbax), and a cluster (KubeRay, `ray up`, SLURM) is
one address away. Each shard is one row of the dataset and one task running the function the single-process job
runs (`pretokenize.write_one`), so the corpus is byte-identical to that job's. Ray Data retries a task whose worker or
node died (an error in the data is not retried: it is one error line); the retry rewrites its shard from the start
(`token_store.write_shard` removes the shard's completion record first and writes it last), so no row is written
twice.
"""

import shutil
import signal
import tempfile
import threading
from collections.abc import Callable

_WORKER_ENV = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}  # CPU work only


def _write_row(row: dict, jobs: list, write: Callable) -> dict:
  return dict(id=row["id"], **write(jobs[row["id"]]))


def _task_error(error: BaseException, error_types: tuple[type, ...]) -> BaseException | None:
  """The error of one of `error_types` a failed task raised, read from Ray's wrapper (which carries the task's
  traceback)."""
  for line in str(error).splitlines():
    for error_type in error_types:
      marker = f"{error_type.__name__}: "
      if marker in line:
        return error_type(line.split(marker, 1)[1].strip())
  return None


def run(
  jobs: list,
  write: Callable,
  workers: int,
  address: str,
  finished: Callable[[object, dict], None],
  error_types: tuple[type, ...] = (ValueError,),
) -> None:
  """Runs `write(job)` (a module-level function, or a partial of one) for every job on Ray, at most `workers` at a
  time, calling `finished(job, record)` as each completes; a task's error of one of `error_types` is raised here as itself.
  `address` "" starts a local runner of `workers` CPUs, removed at the end; otherwise it names a running cluster
  (`auto`, `ray://HEAD:10001`) whose nodes have sparsetx installed."""
  import logging

  import ray

  temp_dir = None if address else tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
  where = dict(address=address) if address else dict(num_cpus=workers, include_dashboard=False, _temp_dir=temp_dir)
  on_sigterm = signal.getsignal(signal.SIGTERM)
  ray.init(runtime_env={"env_vars": _WORKER_ENV}, log_to_driver=False, configure_logging=False, **where)
  if on_sigterm is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, on_sigterm)  # Ray's own handler aborts; the program's stops and cleans up
  context = ray.data.DataContext.get_current()
  context.enable_progress_bars = context.print_on_execution_start = context.enable_auto_log_stats = False
  logging.getLogger("ray.data").setLevel(logging.WARNING)  # the program's progress line says how far it is
  try:
    dataset = ray.data.from_items([dict(id=i) for i in range(len(jobs))], override_num_blocks=len(jobs))
    dataset = dataset.map(
      _write_row, fn_kwargs=dict(jobs=jobs, write=write), num_cpus=1, compute=ray.data.TaskPoolStrategy(size=workers)
    )
    try:
      for row in dataset.iter_rows():
        record = dict(row)
        finished(jobs[record.pop("id")], record)
    except Exception as error:  # noqa: BLE001  (Ray's wrappers of a task's error)
      task_error = _task_error(error, error_types)
      if task_error is None:
        raise
      raise task_error from None
  finally:
    ray.shutdown()
    if temp_dir:
      shutil.rmtree(temp_dir, ignore_errors=True)
