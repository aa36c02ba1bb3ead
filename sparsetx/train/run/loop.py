"""The training loop: mesh -> sharded state -> data -> jitted steps -> metrics, evals, checkpoints.

More: docs/modules.md, sparsetx/train/run/loop.py.
"""

import contextlib
import functools
import json
import math
import signal
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions
from etils import epath
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import check_training_files, global_stream, pretokenize
from sparsetx.kernels import autotune_table
from sparsetx.models import ladder
from sparsetx.parallel import logical_rules
from sparsetx.train import optimizer, step_kernels
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import compile_cache, ctrl_c, goodput, recovery
from sparsetx.train.run import watchdog as watchdog_lib
from sparsetx.train.run.recovery import BadStepsError, NonFiniteLossError  # noqa: F401  (the trainer's errors)
from sparsetx.train.tracking import metrics as metrics_lib
from sparsetx.train.tracking import usage_window

AGREE_EVERY_S = 5.0  # processes agree on SIGTERM and on a save by time at least this often


class _Agreement:
  """SIGTERM (preemption) or a first Ctrl-C, and config.checkpoint.every_minutes, agreed by every process at the same step: a signal
  reaches the processes between different steps, and all must stop (and save) at the same step or their
  collectives would mismatch.

  One process decides alone, every step. Several agree through a collective (which waits for the step the devices
  run) at steps all of them know: each agreement also fixes the next one, process 0's measured step time making it
  about AGREE_EVERY_S seconds later, so a preemption's grace period is never spent waiting for log_every steps."""

  def __init__(self, every_minutes: float):
    self.raised = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)
    self._ctrl_c = ctrl_c.CtrlC(self._interrupted)  # the first Ctrl-C as SIGTERM; a second aborts at once
    self._save_every_s = 60.0 * every_minutes
    self._saved_at = time.monotonic()
    self._next = 1  # the next step to agree at (several processes)
    self._step_s = None

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint at the current step, then stopping.")
    self.raised = True

  def _interrupted(self):
    logging.warning(
      "Ctrl-C received: saving a checkpoint at the current step, then stopping (Ctrl-C again stops at once, "
      "without saving)."
    )
    self.raised = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)
    self._ctrl_c.restore()

  def saved(self) -> None:
    """A checkpoint was saved (by step count or time): the save clock starts again."""
    self._saved_at = time.monotonic()

  def rewound(self, step: int) -> None:
    """A rollback restored `step`: the next agreement is at the next step (every process rolled back at the same
    step, so all agree on it), and the save clock starts again from the restored checkpoint."""
    self._next = step + 1
    self.saved()

  def read(self, step_s: float | None) -> None:
    """A step's metrics were read, with the host's measure of its time (None: not a plain step)."""
    self._step_s = step_s or self._step_s

  def at(self, step: int) -> tuple[bool, bool]:
    """(stop, save) at `step`: SIGTERM reached some process; some process's save clock ran out."""
    save_due = bool(self._save_every_s) and time.monotonic() - self._saved_at >= self._save_every_s
    if jax.process_count() == 1:
      return self.raised, save_due
    if step < self._next:
      return False, False
    interval = max(1, int(AGREE_EVERY_S / self._step_s)) if self._step_s else 1
    votes = multihost_utils.process_allgather(np.array([self.raised, save_due, interval], np.int64))
    self._next = step + int(votes[0, 2])  # process 0's proposal: every process takes the same
    return bool(votes[:, 0].any()), bool(votes[:, 1].any())


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


SCHEDULE_FIELDS = ("steps", "schedule", "learning_rate", "warmup_steps", "decay_fraction")  # what sets each step's rate


def check_schedule(saved: ml_collections.ConfigDict, train: ml_collections.ConfigDict, step: int, where: str) -> None:
  """Refuses to resume `step` (saved in `where` with config.train `saved`) under a learning-rate schedule that gives
  the steps still to run other rates, naming what changes and the next step's rate before and after, unless
  config.train.accept_schedule_change: a longer `steps` moves the decay, so the rate jumps back up from where the
  saved run had decayed it."""
  changed = [name for name in SCHEDULE_FIELDS if name in saved and saved[name] != train[name]]
  if not changed:
    return
  counts = np.arange(step, max(step + 1, train.steps))  # the optimizer counts of the updates still to run
  rates = [np.asarray(optimizer.learning_rate_schedule(t)(counts)) for t in (saved, train)]
  if np.allclose(rates[0], rates[1], rtol=1e-6, atol=0.0):  # e.g. a longer run without decay: the same rates
    return
  before, after = float(rates[0][0]), float(rates[1][0])
  what = ", ".join(f"config.train.{name} {saved[name]!r} -> {train[name]!r}" for name in changed)
  if train.get("accept_schedule_change", False):
    logging.warning(
      "Resuming step %d with a new schedule (%s, config.train.accept_schedule_change): the learning rate of step "
      "%d is %.3g (the saved schedule's: %.3g).",
      *(step, what, step + 1, after, before),
    )
    return
  raise config_lib.ConfigError(
    f"the checkpoint at step {step} in {where} was trained with another learning-rate schedule ({what}): step "
    f"{step + 1}'s rate would be {after:.3g} instead of the saved schedule's {before:.3g}; add "
    "--config.train.accept_schedule_change=True to resume under the new one, or set the fields back."
  )


HEALTH = (
  *("loss", "grad_norm", "param_norm", "skipped", "bad_in_row", "loss_limit", "grad_norm_limit"),
  *("recent_skips", "judged_steps"),
)


class _StepReader:
  """Reads each step's metrics once the host has dispatched the next one: the non-finite check,
  the progress report and the metrics log (every config.train.log_every steps and the last)."""

  def __init__(self, config: ml_collections.ConfigDict, writer, progress, saved_step: int, on_read=None):
    """`on_read(step, step_s)`: after each step read, with the host's measure of its time (None for the first, which
    compiled, and for one whose interval held an evaluation or a save)."""
    self._train, self._writer, self._progress = config.train, writer, progress
    self._on_read = on_read or (lambda step, step_s: None)
    self._read_at, self._plain = time.time(), False
    self._tokens_per_step = config.data.global_batch_size * config.data.seq_len
    self._flops_per_step = (
      3 * ladder.forward_flops_per_token(config.model, config.data.seq_len)["total"] * self._tokens_per_step
    )
    self._peak = metrics_lib.peak_flops_per_device()
    self._console = jax.process_index() == 0  # one progress line per run, not one per process
    self._pending = None
    self._window_start, self._window_steps = time.time(), 0
    self._compiled = False  # the first step read includes the compilation: its time is left out of the rates
    self._since, self._steps_since = time.time(), 0  # for the ETA: every step after the first, evaluations included
    self.saved_step = saved_step  # named by the divergence message
    self.last = {}  # the last metrics logged

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (an evaluation, a checkpoint save) out of the current interval's rates."""
    self._window_start += seconds
    self._plain = False

  def dispatched(self, step: int, metrics: dict) -> None:
    """Takes the metrics of the step just dispatched; reads the step before it."""
    self.read()
    self._pending = step, metrics

  def read(self) -> None:
    """Reads the pending step's metrics (waiting for the devices); a bad step is printed, or raises
    NonFiniteLossError naming the step, or recovery.RollBack or BadStepsError (recovery.verdict)."""
    if self._pending is None:
      return
    (step, metrics), self._pending = self._pending, None
    health = {k: float(v) for k, v in jax.device_get({k: metrics[k] for k in HEALTH}).items()}
    if not self._compiled and step % self._train.log_every and step != self._train.steps:
      self._window_start = self._since = time.time()  # the rates start after the first step (compiled)
    else:
      self._window_steps += 1
      self._steps_since += 1
    self._compiled = True
    now = time.time()
    step_s, self._read_at, self._plain = (now - self._read_at if self._plain else None), now, True
    self._on_read(step, step_s)
    recovery.verdict(step, health, self._train, self.saved_step)
    self._progress(step)
    if step % self._train.log_every == 0 or step == self._train.steps:
      elapsed = time.time() - self._window_start
      self.last = {k: float(v) for k, v in jax.device_get(metrics).items()}
      self.last["tokens_per_sec"] = self._window_steps * self._tokens_per_step / elapsed
      self.last["model_tflops_per_sec"] = self._window_steps * self._flops_per_step / elapsed / 1e12
      if self._peak:
        self.last["mfu"] = self._window_steps * self._flops_per_step / elapsed / (self._peak * jax.device_count())
      if self._window_steps:
        self.last["step_seconds"] = elapsed / self._window_steps
      self.last.update(metrics_lib.device_memory())
      self._writer.write_scalars(step, self.last)
      if self._console:
        logging.info(
          "step %d/%d  loss %.4f  %s  %s tokens/s%s%s  ETA %s",
          step,
          self._train.steps,
          self.last["loss"],
          f"{1e3 * self.last['step_seconds']:,.0f} ms/step" if "step_seconds" in self.last else "compiling",
          f"{self.last['tokens_per_sec']:,.0f}",
          f"  MFU {self.last['mfu']:.1%}" if "mfu" in self.last else "",
          metrics_lib.memory_words(self.last),
          duration((self._train.steps - step) * (time.time() - self._since) / max(self._steps_since, 1)),
        )
      self._window_start, self._window_steps = time.time(), 0


def duration(seconds: float) -> str:
  """`42s`, `3m05s`, `2h07m`: an ETA at a glance."""
  seconds = max(int(round(seconds)), 0)
  if seconds < 60:
    return f"{seconds}s"
  minutes, seconds = divmod(seconds, 60)
  if minutes < 60:
    return f"{minutes}m{seconds:02d}s"
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m"


def summary(config: ml_collections.ConfigDict, built: state_lib.Setup) -> str:
  """One line on what runs: the feed-forward type and size, the parameters, the mesh, the tokens per step."""
  model, data = config.model, config.data
  total = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(built.abstract_state.params))
  active = ladder.param_counts(model)["active"]
  axes = ", ".join(f"{name}={size}" for name, size in built.mesh.shape.items() if size > 1)
  devices = f"{built.mesh.size} {jax.devices()[0].platform} device{'s' if built.mesh.size > 1 else ''}"
  return (
    f"{model.ffn.type} model ({model.n_layers} layers, d_model {model.d_model}): {total / 1e6:,.2f}M parameters "
    f"({active / 1e6:,.2f}M active per token); {f'mesh {axes} over {devices}' if axes else devices}; "
    f"{data.global_batch_size * data.seq_len:,} tokens per step ({data.global_batch_size} x {data.seq_len}), "
    f"{config.train.steps} steps"
  )


def write_config(config: ml_collections.ConfigDict, workdir: str) -> epath.Path:
  """<workdir>/config.json: the whole config of this run (process 0; each start rewrites it)."""
  path = paths.resolve(workdir) / "config.json"
  if jax.process_index() == 0:
    paths.write_text_atomically(path, json.dumps(config.to_dict(), indent=2) + "\n")
  return path


class _Profiler:
  """A jax.profiler trace of the steps config.train.profile_steps=START,COUNT names, written under the
  TensorBoard directory (plugins/profile/<run>/), where TensorBoard's profile plugin finds it. Process 0
  only, or every process with config.train.profile_all_processes."""

  def __init__(self, train: ml_collections.ConfigDict, logdir: epath.Path):
    steps = config_lib.profile_steps(train)
    wanted = steps is not None and (jax.process_index() == 0 or train.get("profile_all_processes", False))
    self._first, self._last = (steps[0], steps[0] + steps[1] - 1) if wanted else (0, -1)
    self._logdir, self._active = logdir, False

  def before(self, step: int) -> None:
    if self._first <= step <= self._last and not self._active:  # a resumed run traces what is left
      self._logdir.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self._logdir))
      self._active = True

  def after(self, step: int, metrics: dict) -> None:
    if self._active and step == self._last:
      jax.block_until_ready(metrics)  # the trace holds the last step's device work
      self.close()
      self._first = self._last + 1
      logging.info("Profile of steps up to %d written under %s/plugins/profile.", step, self._logdir)

  def close(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False


def evaluate(config, params, eval_fn, eval_data, on_batch=lambda: None) -> dict:
  """Loss and perplexity per validation task, each split read once (or eval_batches batches); `on_batch()` after
  each batch (the watchdog's progress)."""
  results = {}
  for name in eval_data.task_names:
    loss_sum, tokens = 0.0, 0.0
    for i, batch in enumerate(eval_data.task_iterator(name)):
      if config.train.eval_batches and i >= config.train.eval_batches:
        break
      out = eval_fn(params, batch)
      loss_sum, tokens = loss_sum + float(out["loss_sum"]), tokens + float(out["tokens"])
      on_batch()
    loss = loss_sum / max(tokens, 1.0)
    results[f"eval/{name}/loss"] = loss
    results[f"eval/{name}/perplexity"] = math.exp(min(loss, 50.0))
  return results


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


def _seek(checkpointer, data_iterator, step: int | None) -> None:
  """The stream at saved `step`'s position (None or 0: the start)."""
  if step:
    data_iterator.restore(checkpointer.data_state(step), f"step {step} in {checkpointer.directory}")
  else:
    data_iterator.seek(0)


def _state_at(config, built: state_lib.Setup, checkpointer, step: int | None):
  """The train state saved at `step`; None: the config's fresh state."""
  if step == 0:  # a start written by sparsetx/tools/sparsify.py: its parameters, fresh optimizer state and data stream
    params = checkpointer.restore_params(0, built.abstract_state.params)
    logging.info("Starting from the step-0 parameters in %s.", checkpointer.directory)
    return state_lib.state_from_params(params, built.shardings, built.model, built.tx, config.train)
  if step is None:
    if jax.process_index() == 0:
      logging.info("No checkpoint in %s: starting at step 0.", checkpointer.directory)
    return state_lib.create_state(config, built.shardings, built.model, built.tx)
  state = checkpointer.restore_state(step, built.abstract_state)
  logging.info("Resumed from %s at step %d.", checkpointer.directory, step)
  return state


def new_row(state):
  """`state` with its count of skipped steps in a row at 0: each start and each rollback counts its own row, so a
  row that ends a run names batches this run read (a row saved inside a checkpoint would start before them)."""
  return state.replace(health=state.health.replace(bad_in_row=state.health.bad_in_row * 0))


def _roll_back(
  config, workdir, built, checkpointer, data_iterator, trouble: recovery.RollBack, window, watchdog, clock
):
  """Restores the newest complete checkpoint at or before `trouble.usable` and records the data from it through the
  bad step's batch as a window every later run steps over (before the restore, so a restart after a kill during it
  steps over the window too). `window`: the bad row's batches (1-based stream positions)."""
  recovery.check_rollbacks_left(workdir, config.train, trouble)
  watchdog.doing(f"the wait for the last save, for the rollback after step {trouble.step}", "save")
  began = time.monotonic()
  checkpointer.wait()
  watchdog.measured("save", time.monotonic() - began)
  checkpointer.manager.reload()
  target = max((s for s in checkpointer.manager.all_steps() if s <= trouble.usable), default=None)
  if jax.process_count() > 1:  # process 0's listing for all: a stale one elsewhere must not pick another state
    target = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if target is None else target)))
    target = None if target < 0 else target
  if target is None:
    raise recovery.BadStepsError(
      f"step {trouble.step} went bad ({trouble.reason}) and no checkpoint at or before step {trouble.usable} exists "
      f"in {checkpointer.directory} to roll back to (config.checkpoint.every={config.checkpoint.every}); rather than "
      f"start over from nothing, the run stops. Step over the bad batches with --config.data.skip_steps="
      f"{window[0]}:{window[1]}, or lower config.train.learning_rate, then run again."
    )
  _seek(checkpointer, data_iterator, target)
  start, end = data_iterator.unskipped(data_iterator.step) + 1, window[1]
  recovery.record(workdir, start, end, trouble, target)
  data_iterator.skip = tuple(sorted((*data_iterator.skip, (start, end))))
  checkpointer.set_aside_after(target)
  watchdog.doing(f"the restore of step {target} for the rollback after step {trouble.step}", "restore")
  began = time.monotonic()
  state = jax.block_until_ready(_state_at(config, built, checkpointer, target))
  watchdog.measured("restore", time.monotonic() - began)
  clock.measured("restore_seconds", time.monotonic() - began)
  watchdog.progress()
  state = new_row(state)  # the steps after the restore train on other data
  logging.warning(
    "Rolled back to step %d after %s; the batches of steps %d:%d (config.data.skip_steps's numbering) are stepped "
    "over, recorded in %s.",
    target,
    f"step {trouble.step} ({trouble.reason})",
    start,
    end,
    paths.resolve(workdir) / recovery.RECORD,
  )
  return state, target


class _Run:
  """What logs a stretch of steps from `start`: the metrics writer, the progress report and the step reader
  (a rollback opens new ones from the step it restored)."""

  def __init__(self, config, workdir, checkpointer, start: int, on_read):
    self.writer = metrics_lib.make_writer(
      workdir, start, fix=checkpointer.newest_complete, metrics_config=config.get("metrics")
    )
    self.progress = periodic_actions.ReportProgress(
      num_train_steps=config.train.steps, writer=self.writer, every_steps=config.train.log_every
    )
    self.reader = _StepReader(config, self.writer, self.progress, saved_step=start, on_read=on_read)

  def close(self) -> None:
    self.writer.flush()
    self.writer.close()


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
  model, batch_sharding = built.model, built.batch_sharding

  # A read or restore that hangs at the start is a hang too; a fresh state's init compiles under the same limit.
  watchdog.doing("the start (the newest checkpoint's checks and restore, or a fresh state's init)", "restore")
  checkpointer = checkpointing.Checkpointer(workdir, config.checkpoint)
  start = checkpointer.resume_step(config.checkpoint.get("restore_step"))  # verified: items, arrays' metadata, data
  if start is not None:
    checkpointer.check_compatible(start, config)
  if start:  # a step-0 start (sparsify, import) has no schedule of its own yet
    check_schedule(checkpointer.saved_config(start).train, config.train, start, str(checkpointer.directory))
  skip = recovery.windows(config, workdir)
  if skip and jax.process_index() == 0:
    logging.info(
      "Stepping over the batches of steps %s (config.data.skip_steps and %s).",
      ", ".join(f"{a}:{b}" for a, b in skip),
      paths.resolve(workdir) / recovery.RECORD,
    )
  data_iterator = global_stream.GlobalStream(config, batch_sharding, skip=skip)
  _seek(checkpointer, data_iterator, start)
  began = time.monotonic()
  state = jax.block_until_ready(_state_at(config, built, checkpointer, start))
  resumed = bool(start)  # from a checkpoint the run saved (not a fresh state, nor a sparsified step-0 start)
  if resumed:
    state = new_row(state)
    clock.measured("restore_seconds", time.monotonic() - began)
    watchdog.measured("restore", time.monotonic() - began)
  start = start or 0
  checkpointer.set_aside_after(start)  # a restore_step before the newest: later steps move to superseded/
  with paths.writing(f"writing {paths.resolve(workdir) / 'config.json'}", checkpointer.newest_complete):
    logging.info("%s; config: %s", summary(config, built), write_config(config, workdir))

  if start >= config.train.steps and jax.process_index() == 0:
    logging.info(
      "The run in %s is finished (step %d, config.train.steps=%d): nothing to train. To train further, run again "
      "with a larger --config.train.steps and --config.train.accept_schedule_change=True (the schedule is recomputed "
      "for the new length), or start another --workdir.",
      *(paths.resolve(workdir), start, config.train.steps),
    )
  step_fn = step_lib.make_train_step(config, built)
  eval_fn = step_lib.make_eval_step(model, built.shardings.params, batch_sharding)
  eval_data = global_stream.TokenizedEvalData(config, batch_sharding, split="validation", required=False)
  if not eval_data.task_names:
    logging.warning("No task of config.data.mixture has a validation split: this run evaluates nothing.")

  agreement = _Agreement(config.checkpoint.get("every_minutes", 0.0))
  usage, usage_every = (
    usage_window.Reader(config.model, built.shardings.usage, workdir),
    usage_window.window(config.train),
  )

  startup = {}  # the first step's compile and its end, after the trainer started: what a warm cache shortens

  def on_read(step: int, step_s: float | None) -> None:
    watchdog.progress(step, step_s)
    clock.reached(step)
    agreement.read(step_s)
    if step % config.train.log_every == 0:
      clock.save()  # a run that dies later leaves this record: its restart counts what came after as lost
    if "first_step_seconds" not in startup:
      startup["first_step_seconds"] = time.time() - started
      if resumed:  # what a restart costs: the start, the restore and the compile, to the first step
        clock.measured("restart_seconds", startup["first_step_seconds"])
      run.writer.write_scalars(step, {f"startup/{k}": v for k, v in startup.items()})
      if jax.process_index() == 0:
        logging.info(
          "Step %d finished %.1f s after the start; its compile took %.1f s.",
          step,
          startup["first_step_seconds"],
          startup["compile_seconds"],
        )

  def save(step: int, what: str) -> None:
    """Saves `step` (its blocking part: the wait for the previous save and the copy off the devices)."""
    watchdog.doing(what, "save")
    clock.part("checkpoint")
    began = time.monotonic()
    checkpointer.save(step, state, config, data_iterator.state())
    took = time.monotonic() - began
    watchdog.measured("save", took)
    clock.measured("save_seconds", took)
    clock.save()
    run.reader.exclude(took)
    watchdog.progress()
    run.reader.saved_step = step
    agreement.saved()

  run = _Run(config, workdir, checkpointer, start, on_read)
  if start == 0 and jax.process_index() == 0:
    run.writer.write_hparams(
      {k: v for k, v in _flatten(config.to_dict()).items() if isinstance(v, (int, float, str, bool))}
    )
  profiler = _Profiler(config.train, metrics_lib.tensorboard_dir(workdir))
  step = start
  evaluated = False  # the first evaluation compiles its step
  # The stream position of each dispatched step's batch, kept for the last max_bad_in_row steps (a bad row's window).
  positions = {}
  clock.save()  # the run's first record: one killed from here on is counted lost at the next start
  if step < config.train.steps:
    watchdog.doing(f"reading the batch of step {step + 1}")
    batch, positions[step + 1] = next(data_iterator), data_iterator.step - 1
  try:
    while step < config.train.steps:
      try:
        profiler.before(step + 1)
        compiling = "compile_seconds" not in startup  # the first call traces and compiles
        watchdog.doing(f"step {step + 1}{' (its compile)' if compiling else ''}", "compile" if compiling else "step")
        if compiling:
          clock.part("compile")
        else:
          clock.stepping(step + 1)
        dispatched = time.time()
        with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
          state, step_metrics = step_fn(state, batch)
        if compiling:
          startup["compile_seconds"] = time.time() - dispatched
          watchdog.measured("compile", startup["compile_seconds"])
          clock.stepping(step + 1)
        step += 1
        profiler.after(step, step_metrics)
        run.reader.dispatched(step, step_metrics)  # reads step - 1's metrics: the devices still run `step`
        if state.usage and (step % usage_every == 0 or step == config.train.steps):
          state = usage.read(step, state, run.writer)
        checkpointer.check_saved()  # a save that failed stops the run before another step
        if eval_data.task_names and (step % config.train.eval_every == 0 or step == config.train.steps):
          run.reader.read()  # waits for `step`: evaluate only a state known finite
          what = f"the evaluation after step {step}"
          watchdog.doing(f"{what} (its compile)" if not evaluated else what, "step" if evaluated else "compile")
          clock.part("evaluation")
          began = time.time()
          results = evaluate(config, state.params, eval_fn, eval_data, on_batch=functools.partial(watchdog.doing, what))
          evaluated = True
          run.reader.exclude(time.time() - began)
          run.writer.write_scalars(step, results)
          if jax.process_index() == 0:
            losses = [
              f"{key[len('eval/') : -len('/loss')]} {value:.4f}" for key, value in results.items() if "/loss" in key
            ]
            logging.info("step %d  eval loss: %s", step, ", ".join(losses))
        last = step == config.train.steps
        stop, save_by_time = (False, False) if last else agreement.at(step)
        if step % config.checkpoint.every == 0 or last or stop or save_by_time:
          run.reader.read()  # waits for `step`: save only a state known finite, before step + 1 takes its buffers
          save(step, f"saving step {step}")
        if last or stop:
          run.reader.read()
          break
        watchdog.doing(f"reading the batch of step {step + 1}")
        clock.part("data_wait")
        batch, positions[step + 1] = next(data_iterator), data_iterator.step - 1  # placed while `step` runs
        positions = {s: p for s, p in positions.items() if s >= step - config.train.max_bad_in_row}
      except recovery.RollBack as trouble:
        # The row's batches, 1-based as config.data.skip_steps (a row begun before a resume: from the resume on).
        first = positions.get(trouble.first_bad, min(positions.values()))
        window = first + 1, positions[trouble.step] + 1
        if config.train.get("bad_steps", "stop") != "rollback":
          raise recovery.skipped_in_row(trouble, window, run.reader.saved_step, config.train.max_bad_in_row) from None
        run.close()
        clock.part("checkpoint")
        state, step = _roll_back(config, workdir, built, checkpointer, data_iterator, trouble, window, watchdog, clock)
        agreement.rewound(step)
        run = _Run(config, workdir, checkpointer, step, on_read)
        batch, positions = next(data_iterator), {}
        positions[step + 1] = data_iterator.step - 1
    watchdog.doing("the last checkpoint's save", "save")
    clock.part("checkpoint")
    began = time.monotonic()
    checkpointer.wait()
    watchdog.measured("save", time.monotonic() - began)
    clock.stopped_as("finished" if step == config.train.steps else "stopped")
    if step < config.train.steps and jax.process_index() == 0:
      logging.info(
        "Stopped at step %d of %d, saved in %s; the same command resumes from it.",
        step,
        config.train.steps,
        checkpointer.directory,
      )
    run.writer.write_scalars(step, clock.metrics())
    run.close()  # a failure leaves W&B's run to W&B's own exit hook, which marks it failed
  finally:
    profiler.close()
    agreement.restore()
    watchdog.doing("the checkpointer's close (the wait for the save under way)", "save")
    checkpointer.close()  # after a failure elsewhere: waits for the save under way
    data_iterator.close()
  return run.reader.last


def _flatten(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
