"""Each step's metrics, read once the host has dispatched the next step: the health verdict (bad steps, divergence),
the progress report and the metrics log of a stretch of steps (`Logs`: its writer, reopened by a rollback).

More: docs/modules.md.
"""

import time

import jax
import ml_collections
from absl import logging
from clu import periodic_actions

from sparsetx.models import ladder
from sparsetx.train.run import recovery
from sparsetx.train.run.operation import Operation
from sparsetx.train.tracking import metrics as metrics_lib

HEALTH = (
  *("loss", "grad_norm", "param_norm", "skipped", "bad_in_row", "loss_limit", "grad_norm_limit"),
  *("recent_skips", "judged_steps"),
)


class StepReader:
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


class Logs:
  """What logs a stretch of steps from `start`: the metrics writer, the progress report and the step reader
  (a rollback opens new ones from the step it restored)."""

  def __init__(self, config, workdir, checkpointer, start: int, on_read):
    self.writer = metrics_lib.make_writer(
      workdir, start, fix=checkpointer.newest_complete, metrics_config=config.get("metrics")
    )
    self.progress = periodic_actions.ReportProgress(
      num_train_steps=config.train.steps, writer=self.writer, every_steps=config.train.log_every
    )
    self.reader = StepReader(config, self.writer, self.progress, saved_step=start, on_read=on_read)

  def close(self) -> None:
    self.writer.flush()
    self.writer.close()


class ReadMetrics(Operation):
  """The step before the one just dispatched: its metrics read (the devices run the new one meanwhile)."""

  def after_step(self, run, metrics: dict) -> None:
    run.logs.reader.dispatched(run.step, metrics)
