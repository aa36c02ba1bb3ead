"""`python -m sparsetx.train --config=configs/tiny.py --workdir=DIR [--config.train.steps=200 ...]`.

Every config field can be overridden on the command line (ml_collections config_flags). A bad config file, override,
mesh, batch size, workdir or checkpoint ends the run with one `error:` line naming the file or field and exit code 2
(sparsetx/cli.py); a damaged newest checkpoint names the older steps to resume from with --config.checkpoint.restore_step=N.
Multi-host: the process joins the run its environment describes (SLURM, JobSet, TPU VM pod; see
sparsetx/parallel/distributed.py), the flags --coordinator_address, --num_processes, --process_id
override it; a run whose peers do not all connect ends with exit code 4. Exit 3: a divergence
(config.train.bad_steps); 5: a failed write to storage; 6: the hang watchdog (config.train.step_timeout_s);
0 after SIGTERM or a first Ctrl-C (a checkpoint at the agreed step); 130: Ctrl-C again, or outside the steps.
"""

import os
import pathlib
import re
import sys

from absl import flags, logging

from sparsetx import cli
from sparsetx.config import ConfigError

# The default job, `make train`'s, found beside the package (a checkout or an editable install) from any directory;
# an install without the repository's configs/ has no default.
DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py"


def default_config() -> str | None:
  return str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None


def config_given(argv: list[str]) -> bool:
  return any(re.fullmatch(r"--?config(=.*)?", arg, re.S) for arg in argv[1:])


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    config=cli.define_config_file("config", default_config(), "Config file, optionally with ':ARG'.", lock_config=True),
    workdir=flags.DEFINE_string(
      "workdir", None, "Directory for checkpoints, metrics and TensorBoard logs.", required=True
    ),
    coordinator_address=flags.DEFINE_string(
      "coordinator_address", None, "Multi-host: HOST:PORT of process 0 (overrides the environment)."
    ),
    num_processes=flags.DEFINE_integer(
      "num_processes", None, "Multi-host: number of processes (overrides the environment)."
    ),
    process_id=flags.DEFINE_integer(
      "process_id", None, "Multi-host: this process's index, 0-based (overrides the environment)."
    ),
    local_device_ids=flags.DEFINE_list(
      "local_device_ids", None, "Multi-host: the local GPU ids this process uses, e.g. 0,1."
    ),
    distributed_timeout=flags.DEFINE_integer(
      "distributed_timeout", 300, "Multi-host: seconds to wait for all processes to connect."
    ),
    heartbeat_timeout=flags.DEFINE_integer(
      "heartbeat_timeout", 100, "Multi-host: seconds without a heartbeat before a peer counts as dead."
    ),
  )


def absl_main(argv, holders: dict, defaulted: bool = False):
  del argv
  args = cli.flag_values(holders)
  if args.config is None:  # no --config, and no checkout's configs/ beside the package
    cli.fail(ConfigError("--config is required (e.g. --config=configs/tiny.py from a checkout of sparsetx)."))
  if defaulted:
    logging.info(
      "No --config given: training the default, configs/tiny.py (%s: the tiny sgatlin model on the embedded "
      "corpus); --config=FILE[:ARG] picks another.",
      DEFAULT_CONFIG,
    )
  from sparsetx import config as config_lib
  from sparsetx.data import check_training_files
  from sparsetx.parallel import distributed

  try:
    check_training_files(
      config_lib.validate(args.config)
    )  # before joining peers: a bad value is reported by every process alike
    spec = distributed.detect(
      os.environ,
      coordinator_address=args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
      local_device_ids=[int(i) for i in args.local_device_ids or []],
      tpu_present=distributed.tpu_vm_present(),
    )
    from sparsetx.plan import autotune  # noqa: PLC0415 (after flags: a fast --help)

    if autotune.will_measure(args.config, spec):  # before JAX starts: the kernels' child processes need room
      autotune.leave_device_memory_to_children()
    distributed.initialize(spec, timeout_s=args.distributed_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
  except ConfigError as error:
    cli.fail(error, 2)
  except distributed.DistributedError as error:
    cli.fail(error, 4)
  # After joining (a missing peer is reported before the slow imports) and after flags (fast --help).
  from sparsetx import paths
  from sparsetx.data.token_store import CorpusError
  from sparsetx.train.run import ctrl_c
  from sparsetx.train.run.loop import NonFiniteLossError, train

  try:
    train(args.config, args.workdir)
  except (ConfigError, CorpusError) as error:  # a missing or damaged tokenized shard: one line naming it
    cli.fail(error, 2)
  except NonFiniteLossError as error:
    cli.fail(error, 3)
  except paths.StorageError as error:  # a full disk, a quota, a read-only store: one line, the newest complete step
    cli.fail(error, paths.STORAGE_EXIT_CODE)
  except KeyboardInterrupt:  # Ctrl-C before the steps (the loop's own handler saves) or after them: no traceback
    cli.fail(
      f"stopped by Ctrl-C outside the training steps, where nothing is saved; the same command resumes from the "
      f"newest complete checkpoint in {args.workdir}/checkpoints, or starts over if there is none.",
      ctrl_c.ABORT_EXIT_CODE,
    )
  distributed.shutdown()
  logging.info("Done. Checkpoints: %s/checkpoints, TensorBoard: %s/tensorboard", args.workdir, args.workdir)


def main():
  """`python -m sparsetx.train` and the `sparsetx-train` script."""
  holders, defaulted = define_flags(), not config_given(sys.argv)
  cli.run(lambda argv: absl_main(argv, holders, defaulted))


if __name__ == "__main__":
  main()
