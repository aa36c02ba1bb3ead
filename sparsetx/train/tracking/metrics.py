"""Metric writers (clu: TensorBoard event files, metrics.jsonl, and W&B where config.metrics.wandb says) and MFU.

Only process 0 writes; other processes get a writer that writes nothing. The console gets the loop's one
progress line per log interval (sparsetx/train/run/loop.py), not every metric. Model FLOPs come from the
ladder's accounting (3 x forward FLOPs per token); MFU divides by the bf16 peak of the device kind.

A run that starts at step S (0, or the step it resumes from) keeps one value per step: metrics.jsonl
loses the rows an earlier run logged past S (rewritten atomically), and the new TensorBoard event file
starts with a SessionLog START event at step S + 1, which makes TensorBoard discard the older events
of steps S + 1 and later (its purge of orphaned data, as PyTorch's `purge_step` does).
"""

import json
from collections.abc import Callable

import jax
import tensorflow as tf
from absl import logging
from clu import metric_writers
from clu.metric_writers import interface
from etils import epath
from tensorboard.compat.proto import event_pb2
from tensorflow.python.ops import summary_ops_v2

from sparsetx import config as config_lib
from sparsetx import hardware, paths
from sparsetx.train.tracking import scalars_only


def peak_flops_per_device() -> float | None:
  """The device kind's bf16 peak (hardware.py, the one chip table), or None where unknown (CPU: MFU is n/a)."""
  chip = hardware.chip_of(jax.devices()[0].device_kind)
  return chip.peak_flops if chip else None


def device_memory() -> dict:
  """{memory/in_use_gib, memory/peak_gib} of this process's first device, where the backend keeps memory_stats()
  (GPU, TPU; not the CPU): {} elsewhere."""
  stats = jax.local_devices()[0].memory_stats() or {}
  found = {
    "memory/in_use_gib": stats.get("bytes_in_use"),
    "memory/peak_gib": stats.get("peak_bytes_in_use"),
  }
  return {name: value / 2**30 for name, value in found.items() if value is not None}


def memory_words(metrics: dict) -> str:
  """'  memory 12.3 GiB (peak 15.1 GiB)' for the console line, or '' where the backend keeps none."""
  if "memory/in_use_gib" not in metrics:
    return ""
  peak = f" (peak {metrics['memory/peak_gib']:.1f} GiB)" if "memory/peak_gib" in metrics else ""
  return f"  memory {metrics['memory/in_use_gib']:.1f} GiB{peak}"


def drop_rows_after(path: epath.Path, step: int) -> int:
  """Rewrites metrics.jsonl (atomically) without its rows past `step`; returns how many were dropped."""
  if not path.exists():
    return 0
  lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
  kept = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= step:
        kept.append(line if line.endswith("\n") else line + "\n")
    except (ValueError, KeyError, TypeError):  # a row cut short by a kill: it belongs to no step
      pass
  if len(kept) != len(lines):
    paths.write_text_atomically(path, "".join(kept))
  return len(lines) - len(kept)


class JsonlWriter(scalars_only.ScalarsOnly):
  """Appends one JSON object per write_scalars call to <workdir>/metrics.jsonl, each written and closed at once
  (tail -f works; a failed write, a full disk, leaves nothing buffered to fail again)."""

  def __init__(self, path: epath.Path):
    self._path = path

  def write_scalars(self, step, scalars):
    row = json.dumps({"step": int(step), **{k: float(v) for k, v in scalars.items()}}) + "\n"
    with self._path.open("a", encoding="utf-8") as file:
      file.write(row)


def tensorboard_dir(workdir: str) -> epath.Path:
  return paths.resolve(workdir) / "tensorboard"


def tensorboard_writer(logdir: epath.Path, start_step: int) -> interface.MetricWriter:
  """clu's TensorBoard writer whose file opens with the START event that purges older events past `start_step`."""
  writer = metric_writers.SummaryWriter(str(logdir))
  event = event_pb2.Event(step=start_step + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
  with writer._summary_writer.as_default():  # clu keeps its tf.summary writer private  # noqa: SLF001
    summary_ops_v2.import_event(tf.constant(event.SerializeToString()))
  return writer


class RunWriter(metric_writers.MultiWriter):
  """The run's writers, each write's failure (a full disk) one `paths.StorageError` line naming the step, the
  workdir, the OS's words and `fix()` (what the run can resume from)."""

  def __init__(self, writers: list, workdir: epath.Path, fix: Callable[[], str]):
    super().__init__(writers)
    self._workdir, self._fix = workdir, fix

  def _writing(self, what: str):
    return paths.writing(f"writing {what} in {self._workdir}", self._fix)

  def write_scalars(self, step, scalars):
    with self._writing(f"step {step}'s metrics"):
      super().write_scalars(step, scalars)

  def write_hparams(self, hparams):
    with self._writing("the hyperparameters"):
      super().write_hparams(hparams)

  def flush(self):
    with self._writing("the metrics"):
      super().flush()


def make_writer(
  workdir: str, start_step: int = 0, fix: Callable[[], str] = lambda: paths.FREE_SPACE, metrics_config=None
) -> RunWriter:
  """The writer of a run starting at `start_step`: what an earlier run logged past it is dropped (see above).
  `fix()` ends the line of a failed write; `metrics_config` (config.metrics) adds Weights & Biases."""
  workdir = paths.resolve(workdir)
  if jax.process_index() != 0:
    return RunWriter([], workdir, fix)
  jsonl = workdir / "metrics.jsonl"
  with paths.writing(f"writing {jsonl}", fix):
    if dropped := drop_rows_after(jsonl, start_step):
      logging.info(
        "Starting at step %d: dropped %d rows of %s logged after it by an earlier run.", start_step, dropped, jsonl
      )
    writers = [tensorboard_writer(tensorboard_dir(workdir), start_step), JsonlWriter(jsonl)]
  if config_lib.wandb_on(metrics_config):
    from sparsetx.train.tracking import wandb_writer  # noqa: PLC0415  (the optional extra, imported only when used)

    writers.append(wandb_writer.WandbWriter(metrics_config.wandb, workdir))
  return RunWriter(writers, workdir, fix)
