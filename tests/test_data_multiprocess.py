"""Two real processes (jax.distributed on CPU) build one global batch from their own data shards."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sparsetx import config as config_lib
from sparsetx.data import pipeline

config = config_lib.default_config()
config.data.update(dict(mixture=(("facts", 1.0),), seq_len=64, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64))
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data", None))
iterator = pipeline.make_train_iterator(config, sharding)
iterator.save(out + "/state")
local = iterator.next_local()
iterator.restore(out + "/state")
batch = next(iterator)
gathered = multihost_utils.process_allgather(batch["targets"], tiled=True)
eval_batches = list(pipeline.make_eval_iterator(config, sharding))
json.dump(dict(shard=[iterator.shard_info.index, iterator.shard_info.num_shards], local=local["targets"].tolist(),
               rows=sorted({i[0].start for i in sharding.addressable_devices_indices_map((8, 64)).values()}),
               gathered=np.asarray(gathered).tolist(), eval_batches=len(eval_batches)),
          open(f"{out}/process_{process_id}.json", "w"))
jax.distributed.shutdown()
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_each_process_reads_its_shard_into_one_global_batch(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  port = str(_free_port())
  workers = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, str(i), port, str(tmp_path)],
      env=env,
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = [w.communicate(timeout=240)[0] for w in workers]
  for worker, log in zip(workers, logs):
    assert worker.returncode == 0, log[-3000:]
  results = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
  assert [r["shard"] for r in results] == [[0, 2], [1, 2]]
  global_targets = np.array(results[0]["gathered"])
  np.testing.assert_array_equal(global_targets, np.array(results[1]["gathered"]))
  assert global_targets.shape == (8, 64)
  for r in results:  # each process's 4 rows sit where its devices hold them
    first = min(r["rows"])
    np.testing.assert_array_equal(global_targets[first : first + 4], np.array(r["local"]))
  assert not {tuple(row) for row in results[0]["local"]} & {tuple(row) for row in results[1]["local"]}
  assert results[0]["eval_batches"] == results[1]["eval_batches"] > 0
