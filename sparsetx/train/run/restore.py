"""Where a run starts and where a rollback returns: the run at its first step (the newest checkpoint checked and
restored, or a fresh state; the config written), the stream's position and the train state at a saved step, and the
rollback to the newest checkpoint before a row of bad steps.

More: docs/modules.md.
"""

import json
import math
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx import paths
from sparsetx.data import global_stream
from sparsetx.models import ladder
from sparsetx.train import optimizer
from sparsetx.train import state as state_lib
from sparsetx.train import step as step_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import recovery
from sparsetx.train.run.agreement import Agreement
from sparsetx.train.run.operation import Run
from sparsetx.train.run.operations.reading import Logs

SCHEDULE_FIELDS = ("steps", "schedule", "learning_rate", "warmup_steps", "decay_fraction")  # what sets each step's rate


def check_schedule(saved: ml_collections.ConfigDict, train: ml_collections.ConfigDict, step: int, where: str) -> None:
  """Refuses to resume `step` (saved in `where` with config.train `saved`) under a learning-rate schedule that gives
  the steps still to run other rates, naming what changes and the first changed step's rate before and after, unless
  config.train.accept_schedule_change: a longer `steps` moves the decay, so the rate jumps back up from where the
  saved run had decayed it."""
  changed = [name for name in SCHEDULE_FIELDS if name in saved and saved[name] != train[name]]
  if not changed:
    return
  counts = np.arange(step, max(step + 1, train.steps))  # the optimizer counts of the updates still to run
  rates = [np.asarray(optimizer.learning_rate_schedule(t)(counts)) for t in (saved, train)]
  differ = ~np.isclose(rates[0], rates[1], rtol=1e-6, atol=0.0)
  if not differ.any():  # e.g. a longer run without decay: the same rates
    return
  first = int(np.argmax(differ))  # the first update whose rate changes (often in the decay, long after `step`)
  before, after = float(rates[0][first]), float(rates[1][first])
  what = ", ".join(f"config.train.{name} {saved[name]!r} -> {train[name]!r}" for name in changed)
  if train.get("accept_schedule_change", False):
    logging.warning(
      "Resuming step %d with a new schedule (%s, config.train.accept_schedule_change): the learning rate of step "
      "%d is %.3g (the saved schedule's: %.3g).",
      *(step, what, step + 1 + first, after, before),
    )
    return
  raise config_lib.ConfigError(
    f"the checkpoint at step {step} in {where} was trained with another learning-rate schedule ({what}): step "
    f"{step + 1 + first}'s rate would be {after:.3g} instead of the saved schedule's {before:.3g}; add "
    "--config.train.accept_schedule_change=True to resume under the new one, or set the fields back."
  )


def seek(checkpointer, data_iterator, step: int | None) -> None:
  """The stream at saved `step`'s position (None or 0: the start)."""
  if step:
    data_iterator.restore(checkpointer.data_state(step), f"step {step} in {checkpointer.directory}")
  else:
    data_iterator.seek(0)


def state_at(config, built: state_lib.Setup, checkpointer, step: int | None):
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


def roll_back(run, trouble: recovery.RollBack) -> None:
  """After a row of bad steps: raises recovery.skipped_in_row's error unless config.train.bad_steps is "rollback";
  else the run goes on from the newest complete checkpoint at or before `trouble.usable`, stepping over the row's
  batches (1-based as config.data.skip_steps; a row begun before a resume: from the resume on)."""
  config = run.config
  first = run.positions.get(trouble.first_bad, min(run.positions.values()))
  window = first + 1, run.positions[trouble.step] + 1
  if config.train.get("bad_steps", "stop") != "rollback":
    raise recovery.skipped_in_row(trouble, window, run.logs.reader.saved_step, config.train.max_bad_in_row) from None
  run.logs.close()
  run.clock.part("checkpoint")
  run.state, run.step = _restore_before(run, trouble, window)
  run.agreement.rewound(run.step)
  run.logs = Logs(config, run.workdir, run.checkpointer, run.step, run.after_read)
  run.batch, run.positions = next(run.data), {}
  run.positions[run.step + 1] = run.data.step - 1


def _restore_before(run, trouble: recovery.RollBack, window):
  """Restores the newest complete checkpoint at or before `trouble.usable` and records the data from it through the
  bad step's batch as a window every later run steps over (before the restore, so a restart after a kill during it
  steps over the window too). `window`: the bad row's batches (1-based stream positions)."""
  config, workdir, built, checkpointer = run.config, run.workdir, run.built, run.checkpointer
  data_iterator, watchdog, clock = run.data, run.watchdog, run.clock
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
  seek(checkpointer, data_iterator, target)
  start, end = data_iterator.unskipped(data_iterator.step) + 1, window[1]
  recovery.record(workdir, start, end, trouble, target)
  data_iterator.skip = tuple(sorted((*data_iterator.skip, (start, end))))
  checkpointer.set_aside_after(target)
  watchdog.doing(f"the restore of step {target} for the rollback after step {trouble.step}", "restore")
  began = time.monotonic()
  state = jax.block_until_ready(state_at(config, built, checkpointer, target))
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


def open_run(config, workdir, built, started, clock, watchdog, operations) -> Run:
  """The run at its first step: the newest checkpoint checked and restored (or a fresh state), the stream there, the
  config written, the step made, the operations (classes, in order) and the logs open."""
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
  data_iterator = global_stream.GlobalStream(config, built.batch_sharding, skip=skip)
  seek(checkpointer, data_iterator, start)
  began = time.monotonic()
  state = jax.block_until_ready(state_at(config, built, checkpointer, start))
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

  run = Run(config, workdir, built, started, checkpointer, data_iterator, watchdog, clock, None, state, start, resumed)
  run.step_fn = step_lib.make_train_step(config, built)
  run.operations = tuple(operation(run) for operation in operations)
  run.logs = Logs(config, workdir, checkpointer, start, run.after_read)
  if start == 0 and jax.process_index() == 0:
    run.logs.writer.write_hparams(
      {k: v for k, v in _flatten(config.to_dict()).items() if isinstance(v, (int, float, str, bool))}
    )
  run.agreement = Agreement(config.checkpoint.get("every_minutes", 0.0))  # last: the loop's `finally` restores it
  return run


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


def _flatten(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
