"""The tokenize job's shards as a Ray Data pipeline: a local runner here, a Ray cluster given its address.

Ray, not Beam: Levanter builds its token caches with it, it installs here without moving any pinned library
(Beam would move protobuf and pyarrow under TensorFlow and orbax), and a cluster (KubeRay, `ray up`, SLURM) is
one address away. Each shard is one row of the dataset and one task running `pretokenize.write_one`, the function
the single-process job runs, so the corpus is byte-identical to that job's. Ray retries a task whose worker died;
the retry rewrites its shard from the start (`token_store.write_shard` removes the shard's completion record first
and writes it last), so no row is written twice.
"""

import dataclasses
import shutil
import tempfile
from collections.abc import Callable

MAX_RETRIES = 3  # per shard, for a worker or node that died (an error in the data is not retried)
_WORKER_ENV = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}  # CPU work only


def _write_row(row: dict, data: dict) -> dict:
  from sparsetx.data import pretokenize

  job = pretokenize.ShardJob(**{**row, "inputs": tuple(row["inputs"])})
  return dict(name=job.name, **pretokenize.write_one(job, data))


def _shard_error(error: BaseException):
  """The ShardError a failed task raised, out of Ray's wrappers (its message is the task's last line); or None."""
  from sparsetx.data import pretokenize

  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, pretokenize.ShardError):
      return pretokenize.ShardError(str(error).strip().splitlines()[-1].split("ShardError: ")[-1])
    error = error.__cause__ or getattr(error, "cause", None) or error.__context__
  return None


def run(jobs: list, data: dict, workers: int, address: str, finished: Callable[[object, dict], None]) -> None:
  """Writes every shard of `jobs` (pretokenize.ShardJob) on Ray, at most `workers` at a time, calling
  `finished(job, record)` as each completes. `address` "" starts a local runner of `workers` CPUs, removed at the
  end; otherwise it names a running cluster (`auto`, `ray://HEAD:10001`) whose nodes have sparsetx installed."""
  import ray

  temp_dir = None if address else tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
  where = dict(address=address) if address else dict(num_cpus=workers, include_dashboard=False, _temp_dir=temp_dir)
  ray.init(runtime_env={"env_vars": _WORKER_ENV}, log_to_driver=False, configure_logging=False, **where)
  try:
    by_name = {job.name: job for job in jobs}
    dataset = ray.data.from_items([dataclasses.asdict(job) for job in jobs], override_num_blocks=len(jobs))
    dataset = dataset.map(
      _write_row, fn_kwargs=dict(data=data), num_cpus=1, concurrency=workers, max_retries=MAX_RETRIES
    )
    try:
      for row in dataset.iter_rows():
        record = dict(row)
        finished(by_name[record.pop("name")], record)
    except Exception as error:  # noqa: BLE001  (Ray's wrappers of a task's error)
      shard_error = _shard_error(error)
      if shard_error is None:
        raise
      raise shard_error from None
  finally:
    ray.shutdown()
    if temp_dir:
      shutil.rmtree(temp_dir, ignore_errors=True)
