"""The training loop: mesh -> sharded state -> data -> jitted steps -> metrics, evals, checkpoints.

Each step is dispatched, then each of OPERATIONS has its turn (sparsetx/train/run/operation.py: hooks before and
after a step and after its metrics are read); the loop's body names them in order. More: docs/modules.md.
"""

import contextlib
import time

import jax
import ml_collections
from absl import logging

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import check_training_files, pretokenize
from sparsetx.kernels import autotune_table
from sparsetx.parallel import logical_rules
from sparsetx.train import state as state_lib
from sparsetx.train import step_kernels
from sparsetx.train.run import compile_cache, goodput, recovery, restore
from sparsetx.train.run import watchdog as watchdog_lib
from sparsetx.train.run.operation import Run, each
from sparsetx.train.run.operations import evaluation, profile, progress, reading, saving, usage
from sparsetx.train.run.recovery import BadStepsError, NonFiniteLossError  # noqa: F401  (the trainer's errors)

# What runs around each step, in order (each an Operation in run/operations/: adding one is its file, its line here
# and its name in the import above).
OPERATIONS = (
  profile.Profile,  # a trace of config.train.profile_steps
  reading.ReadMetrics,  # the step before's metrics: health verdict, progress, the log line
  progress.Progress,  # (as each step is read) the watchdog's clock, goodput, the first step's line
  usage.UsageWindow,  # the sparse layers' usage, every config.train.usage_window steps
  saving.CheckSaved,  # a failed background save stops the run
  evaluation.Evaluate,  # every config.train.eval_every steps and the last
  saving.AgreeAndSave,  # a stop or save by time agreed by every process; saves; the last step
)


def check_workdir(workdir: str) -> None:
  """Creates the workdir (a local path or a URL such as gs://bucket/run) and checks that it takes a file."""
  try:
    path = paths.check_writable(workdir, f".write_probe_{jax.process_index()}")
  except paths.storage_errors() as error:  # tf.io.gfile's errors for a remote URL are no OSError
    raise config_lib.ConfigError(
      f"--workdir={workdir} is not writable ({paths.reason(error)}); choose a directory you can write to."
    ) from None
  if (path / "data_state").is_dir():  # sparsetx before the data state became an item of each checkpoint step
    raise config_lib.ConfigError(
      f"--workdir={workdir} holds a run started by an older sparsetx (its data state is in {path / 'data_state'}), "
      "which this version cannot resume; start over with a new --workdir (or delete this one)."
    )


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains to config.train.steps (or until SIGTERM); returns the last step's metrics."""
  started = time.time()
  check_training_files(config_lib.validate(config))
  check_workdir(workdir)
  clock = goodput.Goodput(workdir, started)
  try:
    last = _set_up_and_run(config, workdir, started, clock)
  except BaseException:
    if clock.written:  # a bad config, path or checkpoint found before the first step leaves no record
      clock.stopped_as("failed")
      with contextlib.suppress(Exception):  # the failure's own error is the one to report
        clock.save()
    raise
  clock.save()  # after the run's teardown (the last save's wait included): the parts cover the trainer's wall time
  if jax.process_index() == 0:
    logging.info("%s", clock.table())
  return last


def _set_up_and_run(config, workdir: str, started: float, clock: goodput.Goodput) -> dict:
  """The run inside what it sets up for itself: its compilation cache, the corpus, the kernel table (process 0's,
  on every process) and the model's logical axis rules."""
  with compile_cache.used(config.train, workdir):
    config = pretokenize.train_corpus(config, workdir)  # the corpus the stream reads: given, or written in workdir
    with autotune_table.used(config.train.autotune):  # off: the kernel table is neither read nor written
      if jax.process_count() == 1 and (taken := autotune_table.take_from(paths.resolve(workdir))):
        logging.info("Took %d measured kernel choices from %s.", taken, paths.resolve(workdir) / "autotune.json")
      # Several processes trace with process 0's table, which alone takes the workdir's copy (hosts never race on a
      # shared one, and a failure there stops every process alike).
      with autotune_table.agreed(paths.resolve(workdir)) as agreed:
        if agreed:
          logging.info("Agreed on %d kernel choices from process 0's autotune table.", agreed)
        built = state_lib.setup(config)
        if config.train.autotune and jax.process_count() == 1:  # the device picks its kernels before the step compiles
          step_kernels.ensure_tuned(config, built, report=logging.info)
          autotune_table.keep_in(paths.resolve(workdir))
        with logical_rules.activate(built.mesh, config.mesh.rules):  # sparse layers trace their expert-parallel form
          return _run(config, workdir, built, started, clock)


def _run(
  config: ml_collections.ConfigDict, workdir: str, built: state_lib.Setup, started: float, clock: goodput.Goodput
) -> dict:
  watchdog = watchdog_lib.Watchdog(
    config.train.get("step_timeout_s"),
    jax.process_index(),
    slow={kind: config.train.get(f"{kind}_timeout_s") for kind in ("compile", "save", "restore")},
    peers=watchdog_lib.Peers.of_this_run(jax.process_index()),
  )
  try:
    return _watched_run(config, workdir, built, started, clock, watchdog)
  finally:
    watchdog.close()  # after the checkpointer's close, which waits for the save under way


def _watched_run(config, workdir, built, started, clock: goodput.Goodput, watchdog: watchdog_lib.Watchdog) -> dict:
  run = restore.open_run(config, workdir, built, started, clock, watchdog, OPERATIONS)
  try:
    _first_batch(run)
    _loop(run)
    _finish(run)
  finally:
    try:
      each(run.operations, "at_exit", run)
      watchdog.doing("the checkpointer's close (the wait for the save under way)", "save")
      run.checkpointer.close()  # after a failure elsewhere: waits for the save under way
      run.data.close()
    finally:  # last: a Ctrl-C or SIGTERM during the close is a stop request, not an error hiding the run's own
      run.agreement.restore()
  return run.logs.reader.last


def _loop(run: Run) -> None:
  """Steps to config.train.steps (or an agreed stop): each step dispatched, then the operations' turns."""
  while run.step < run.steps:
    try:
      each(run.operations, "before_step", run)
      metrics = _dispatch(run)  # the step; run.step is the one dispatched
      each(run.operations, "after_step", run, metrics)  # read, log, usage, evaluate, agree, save
      if run.stopping:
        break
      _next_batch(run)
    except recovery.RollBack as trouble:
      restore.roll_back(run, trouble)  # or the run's error, unless config.train.bad_steps="rollback"


def _first_batch(run: Run) -> None:
  run.clock.save()  # the run's first record: one killed from here on is counted lost at the next start
  if run.step < run.steps:
    run.watchdog.doing(f"reading the batch of step {run.step + 1}")
    run.batch, run.positions[run.step + 1] = next(run.data), run.data.step - 1


def _dispatch(run: Run) -> dict:
  """Dispatches step `run.step + 1` (the first call traces and compiles it: startup/compile_seconds); its metrics."""
  compiling = "compile_seconds" not in run.startup
  run.watchdog.doing(f"step {run.step + 1}{' (its compile)' if compiling else ''}", "compile" if compiling else "step")
  if compiling:
    run.clock.part("compile")
  else:
    run.clock.stepping(run.step + 1)
  dispatched = time.time()
  with jax.profiler.StepTraceAnnotation("train", step_num=run.step + 1):
    run.state, metrics = run.step_fn(run.state, run.batch)
  if compiling:
    run.startup["compile_seconds"] = time.time() - dispatched
    run.watchdog.measured("compile", run.startup["compile_seconds"])
    run.clock.stepping(run.step + 1)
  run.step += 1
  return metrics


def _next_batch(run: Run) -> None:
  """The next step's batch, placed while the devices run this one; the positions of the last max_bad_in_row steps'
  batches kept (a bad row's window)."""
  run.watchdog.doing(f"reading the batch of step {run.step + 1}")
  run.clock.part("data_wait")
  run.batch, run.positions[run.step + 1] = next(run.data), run.data.step - 1
  run.positions = {s: p for s, p in run.positions.items() if s >= run.step - run.config.train.max_bad_in_row}


def _finish(run: Run) -> None:
  """After the last step or an agreed stop: the last save's wait, goodput's verdict and the last metrics."""
  run.watchdog.doing("the last checkpoint's save", "save")
  run.clock.part("checkpoint")
  began = time.monotonic()
  run.checkpointer.wait()
  run.watchdog.measured("save", time.monotonic() - began)
  run.clock.stopped_as("finished" if run.step == run.steps else "stopped")
  if run.step < run.steps and jax.process_index() == 0:
    logging.info(
      "Stopped at step %d of %d, saved in %s; the same command resumes from it.",
      run.step,
      run.steps,
      run.checkpointer.directory,
    )
  run.logs.writer.write_scalars(run.step, run.clock.metrics())
  run.logs.close()  # a failure leaves W&B's run to W&B's own exit hook, which marks it failed
