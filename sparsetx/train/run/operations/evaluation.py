"""Evaluation: loss and perplexity on each validation task, every config.train.eval_every steps and after the last.

More: docs/modules.md.
"""

import functools
import math
import time

import jax
from absl import logging

from sparsetx.data import global_stream
from sparsetx.train import step as step_lib
from sparsetx.train.run.operation import Operation


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


class Evaluate(Operation):
  """Evaluates the state after every config.train.eval_every steps and the last, once the step is read (only a state
  known finite is evaluated); its time is left out of the interval's rates."""

  def __init__(self, run):
    built = run.built
    self.eval_fn = step_lib.make_eval_step(built.model, built.shardings.params, built.batch_sharding)
    self.data = global_stream.TokenizedEvalData(run.config, built.batch_sharding, split="validation", required=False)
    if not self.data.task_names:
      logging.warning("No task of config.data.mixture has a validation split: this run evaluates nothing.")
    self.compiled = False  # the first evaluation compiles its step

  def after_step(self, run, metrics: dict) -> None:
    step, config = run.step, run.config
    if not self.data.task_names or (step % config.train.eval_every and step != config.train.steps):
      return
    run.logs.reader.read()  # waits for `step`: evaluate only a state known finite
    what = f"the evaluation after step {step}"
    run.watchdog.doing(f"{what} (its compile)" if not self.compiled else what, "step" if self.compiled else "compile")
    run.clock.part("evaluation")
    began = time.time()
    on_batch = functools.partial(run.watchdog.doing, what)
    results = evaluate(config, run.state.params, self.eval_fn, self.data, on_batch=on_batch)
    self.compiled = True
    run.logs.reader.exclude(time.time() - began)
    run.logs.writer.write_scalars(step, results)
    if jax.process_index() == 0:
      losses = [f"{key[len('eval/') : -len('/loss')]} {value:.4f}" for key, value in results.items() if "/loss" in key]
      logging.info("step %d  eval loss: %s", step, ", ".join(losses))
