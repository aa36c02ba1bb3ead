"""The training loop: mesh -> sharded state -> data -> jitted steps -> metrics, evals, checkpoints.

A run in a workdir that holds checkpoints resumes from the newest one (or config.checkpoint.restore_step,
whose later steps are moved to <workdir>/superseded/), after checking that it can be read (model state,
data position); a step-0 checkpoint (tools/sparsify.py, HF import) gives only the parameters: the
optimizer state and the data stream start fresh from this run's config.
SIGTERM saves the current step and returns normally. A non-finite loss stops the run
before anything non-finite is saved.
"""

import functools
import math
import os
import signal
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions
from jax.experimental import multihost_utils

from sparsetx import config as config_lib
from sparsetx.data import pipeline
from sparsetx.models import ladder
from sparsetx.parallel import expert_parallel, mesh as mesh_lib
from sparsetx.train import checkpointing, metrics as metrics_lib, state as state_lib, step as step_lib
from sparsetx.train.optimizer import learning_rate_schedule


class NonFiniteLossError(RuntimeError):
  """The loss became NaN or infinite; the message names the step."""


class _SigtermFlag:
  """Set by SIGTERM (preemption); the loop saves and stops at the next step boundary."""

  def __init__(self):
    self.raised = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint at the current step, then stopping.")
    self.raised = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)

  def agreed(self) -> bool:
    """True if any process got SIGTERM: signals reach processes between different steps, and all
    processes must stop (and save) at the same step or their collectives would mismatch."""
    if jax.process_count() == 1:
      return self.raised
    return bool(np.any(multihost_utils.process_allgather(np.array(self.raised))))


def check_workdir(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe_{jax.process_index()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as error:
    raise config_lib.ConfigError(
        f"--workdir={workdir} is not writable ({error.strerror}); choose a directory you can write to."
    ) from None


def check_batch_divides(config: ml_collections.ConfigDict, mesh) -> None:
  spec = mesh_lib.batch_sharding(mesh, config.mesh.rules).spec[0]
  axes = spec if isinstance(spec, tuple) else (spec,) if spec else ()
  shards = math.prod(mesh.shape[a] for a in axes)
  for field in ("global_batch_size", "eval_batch_size"):
    size = config.data[field]
    if size % shards:
      raise config_lib.ConfigError(
          f"config.data.{field}={size} is not divisible by the {shards} batch shards of the mesh "
          f"({' x '.join(f'{a}={mesh.shape[a]}' for a in axes)}); use a multiple of {shards}."
      )
  micro = config.data.global_batch_size // config.train.microbatches
  if micro % shards:
    raise config_lib.ConfigError(
        f"config.train.microbatches={config.train.microbatches} leaves {micro} rows per micro-batch, not divisible "
        f"by the {shards} batch shards; use fewer micro-batches or a larger config.data.global_batch_size."
    )


def evaluate(config, params, eval_fn, eval_data: pipeline.EvalData) -> dict:
  """Loss and perplexity per validation task, each split read once (or eval_batches batches)."""
  results = {}
  for name in eval_data.task_names:
    loss_sum, tokens = 0.0, 0.0
    for i, batch in enumerate(eval_data.task_iterator(name)):
      if config.train.eval_batches and i >= config.train.eval_batches:
        break
      out = eval_fn(params, batch)
      loss_sum, tokens = loss_sum + float(out["loss_sum"]), tokens + float(out["tokens"])
    loss = loss_sum / max(tokens, 1.0)
    results[f"eval/{name}/loss"] = loss
    results[f"eval/{name}/perplexity"] = math.exp(min(loss, 50.0))
  return results


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains to config.train.steps (or until SIGTERM); returns the last step's metrics."""
  config_lib.validate(config)
  check_workdir(workdir)
  mesh = mesh_lib.make_mesh(config.mesh)
  check_batch_divides(config, mesh)
  expert_parallel.check_units_divide(config, mesh)
  with expert_parallel.activate(mesh, config.mesh.rules):  # sparse layers trace their expert-parallel form
    return _run(config, workdir, mesh)


def _run(config: ml_collections.ConfigDict, workdir: str, mesh) -> dict:
  abstract_state, shardings, model, tx = state_lib.state_shardings(config, mesh)
  batch_sharding = mesh_lib.batch_sharding(mesh, config.mesh.rules)

  checkpointer = checkpointing.Checkpointer(workdir, config.checkpoint)
  start = checkpointer.resume_step(config.checkpoint.get("restore_step"))  # verified: items, arrays' metadata, data
  if start is not None:
    checkpointer.check_compatible(start, config)
  data_iterator = pipeline.make_train_iterator(config, batch_sharding)
  if start == 0:  # a start written by tools/sparsify.py: its parameters, fresh optimizer state and data stream
    params = checkpointer.restore_params(0, abstract_state.params)
    state = state_lib.state_from_params(params, shardings, model, tx)
    logging.info("Starting from the step-0 parameters in %s.", checkpointer.directory)
  elif start is not None:
    state = restore(checkpointer, start, abstract_state, data_iterator)
    logging.info("Resumed from %s at step %d.", checkpointer.directory, start)
  else:
    state = state_lib.create_state(config, shardings, model, tx)
    start = 0
  checkpointer.set_aside_after(start)  # a restore_step before the newest: later steps move to superseded/

  schedule = learning_rate_schedule(config.train)
  step_fn = jax.jit(
      functools.partial(step_lib.train_step, model=model, train=config.train, schedule=schedule),
      in_shardings=(shardings, batch_sharding),
      out_shardings=(shardings, None),
      donate_argnums=0,
  )
  eval_fn = jax.jit(functools.partial(step_lib.eval_step, model=model), in_shardings=(shardings.params, batch_sharding))
  eval_data = pipeline.EvalData(config, batch_sharding, split="validation")

  writer = metrics_lib.make_writer(workdir)
  if start == 0 and jax.process_index() == 0:
    writer.write_hparams({k: v for k, v in _flatten(config.to_dict()).items() if isinstance(v, (int, float, str, bool))})
  progress = periodic_actions.ReportProgress(num_train_steps=config.train.steps, writer=writer, every_steps=config.train.log_every)
  tokens_per_step = config.data.global_batch_size * config.data.seq_len
  flops_per_step = 3 * ladder.forward_flops_per_token(config.model, config.data.seq_len)["total"] * tokens_per_step
  peak = metrics_lib.peak_flops_per_device()

  sigterm = _SigtermFlag()
  last_metrics, step, saved_step = {}, start, start
  window_start, window_steps = time.time(), 0
  try:
    while step < config.train.steps and not sigterm.agreed():
      batch = next(data_iterator)
      state, step_metrics = step_fn(state, batch)
      step += 1
      window_steps += 1
      health = jax.device_get({k: step_metrics[k] for k in ("loss", "grad_norm", "param_norm")})
      if not all(np.isfinite(v) for v in health.values()):
        raise NonFiniteLossError(
            f"training diverged at step {step} ({', '.join(f'{k}={float(v)}' for k, v in health.items())}); "
            f"nothing after step {saved_step} was saved. Lower config.train.learning_rate or raise "
            "config.train.warmup_steps, then resume."
        )
      progress(step)
      if step % config.train.log_every == 0 or step == config.train.steps:
        elapsed = time.time() - window_start
        last_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        last_metrics["tokens_per_sec"] = window_steps * tokens_per_step / elapsed
        last_metrics["model_tflops_per_sec"] = window_steps * flops_per_step / elapsed / 1e12
        if peak:
          last_metrics["mfu"] = window_steps * flops_per_step / elapsed / (peak * jax.device_count())
        writer.write_scalars(step, last_metrics)
        window_start, window_steps = time.time(), 0
      if step % config.train.eval_every == 0 or step == config.train.steps:
        writer.write_scalars(step, evaluate(config, state.params, eval_fn, eval_data))
      if step % config.checkpoint.every == 0 or step == config.train.steps:
        checkpointer.save(step, state, config, data_iterator)
        saved_step = step
    if step != saved_step:  # stopped by SIGTERM (agreed by all processes) between checkpoints
      checkpointer.save(step, state, config, data_iterator)
  finally:
    sigterm.restore()
    checkpointer.wait()
    checkpointer.close()
    writer.flush()
    data_iterator.close()
  return last_metrics


def restore(checkpointer: checkpointing.Checkpointer, step: int, abstract_state, data_iterator):
  """The state at `step`, and the data position when this run has the data sharding that saved it.

  A data state saved by another number of data shards (another process count) cannot be resharded:
  the model state still restores (onto any mesh), and the data stream starts over, with a warning.
  """
  saved_shards = pipeline.saved_shard_counts(os.path.join(checkpointer.data_directory, str(step)))
  shards = data_iterator.shard_info.num_shards
  if saved_shards and shards not in saved_shards:
    logging.warning(
        "The data state of step %d was saved by %s data shard(s) (processes); this run reads %d, so the data "
        "stream starts over from its beginning. The model and optimizer state resume at step %d.",
        step, "/".join(map(str, sorted(saved_shards))), shards, step)
    return checkpointer.restore_state(step, abstract_state)
  return checkpointer.restore(step, abstract_state, data_iterator)


def _flatten(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
