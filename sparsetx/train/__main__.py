"""`python -m sparsetx.train --config=configs/tiny.py --workdir=DIR [--config.train.steps=200 ...]`.

Every config field can be overridden on the command line (ml_collections config_flags). A bad
config file, override, mesh, batch size, workdir or checkpoint ends the run with one `error:` line
naming the file or field and exit code 2 (sparsetx/cli.py); a damaged newest checkpoint names the
older steps to resume from with --config.checkpoint.restore_step=N.
Multi-host: the process joins the run its environment describes (SLURM, JobSet, TPU VM pod; see
sparsetx/parallel/distributed.py), the flags --coordinator_address, --num_processes, --process_id
override it; a run whose peers do not all connect ends with exit code 4.
"""

import os

from absl import flags, logging

from sparsetx import cli
from sparsetx.config import ConfigError

_CONFIG = cli.define_config_file("config", "configs/tiny.py", "Config file, optionally with ':ARG'.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Directory for checkpoints, metrics and TensorBoard logs.", required=True
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "Multi-host: HOST:PORT of process 0 (overrides the environment)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Multi-host: number of processes (overrides the environment)."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "Multi-host: this process's index, 0-based (overrides the environment)."
)
_LOCAL_DEVICES = flags.DEFINE_list(
  "local_device_ids", None, "Multi-host: the local GPU ids this process uses, e.g. 0,1."
)
_INIT_TIMEOUT = flags.DEFINE_integer(
  "distributed_timeout", 300, "Multi-host: seconds to wait for all processes to connect."
)
_HEARTBEAT = flags.DEFINE_integer(
  "heartbeat_timeout", 100, "Multi-host: seconds without a heartbeat before a peer counts as dead."
)


def main(argv):
  del argv
  from sparsetx import config as config_lib
  from sparsetx.data import check_training_files
  from sparsetx.parallel import distributed

  try:
    check_training_files(
      config_lib.validate(_CONFIG.value)
    )  # before joining peers: a bad value is reported by every process alike
    spec = distributed.detect(
      os.environ,
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
      local_device_ids=[int(i) for i in _LOCAL_DEVICES.value or []],
      tpu_present=distributed.tpu_vm_present(),
    )
    distributed.initialize(spec, timeout_s=_INIT_TIMEOUT.value, heartbeat_timeout_s=_HEARTBEAT.value)
  except ConfigError as error:
    cli.fail(error, 2)
  except distributed.DistributedError as error:
    cli.fail(error, 4)
  # After joining (a missing peer is reported before the slow imports) and after flags (fast --help).
  from sparsetx.data.token_store import CorpusError
  from sparsetx.train.loop import NonFiniteLossError, train

  try:
    train(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, CorpusError) as error:  # a missing or damaged tokenized shard: one line naming it
    cli.fail(error, 2)
  except NonFiniteLossError as error:
    cli.fail(error, 3)
  distributed.shutdown()
  logging.info("Done. Checkpoints: %s/checkpoints, TensorBoard: %s/tensorboard", _WORKDIR.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
