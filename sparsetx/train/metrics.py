"""Metric writers (clu: TensorBoard event files and the log, plus metrics.jsonl) and MFU.

Only process 0 writes; other processes get a writer that only logs. Model FLOPs come from the
ladder's accounting (3 x forward FLOPs per token); MFU divides by the bf16 peak of the device kind.
"""

import json
import os

import jax
from clu import metric_writers
from clu.metric_writers import interface

# Dense bf16 peak FLOP/s per device, by jax's device_kind.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops_per_device() -> float | None:
  """The device kind's bf16 peak, or None where unknown (CPU: MFU is reported as n/a)."""
  kind = jax.devices()[0].device_kind
  return PEAK_FLOPS.get(kind) or next((v for k, v in PEAK_FLOPS.items() if kind.startswith(k)), None)


class JsonlWriter(interface.MetricWriter):
  """Appends one JSON object per write_scalars call to <workdir>/metrics.jsonl."""

  def __init__(self, path: str):
    self._file = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered: tail -f works

  def write_scalars(self, step, scalars):
    self._file.write(json.dumps({"step": int(step), **{k: float(v) for k, v in scalars.items()}}) + "\n")

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def make_writer(workdir: str) -> metric_writers.MetricWriter:
  if jax.process_index() != 0:
    return metric_writers.create_default_writer(None, just_logging=True)
  default = metric_writers.create_default_writer(os.path.join(workdir, "tensorboard"), asynchronous=False)
  return metric_writers.MultiWriter([default, JsonlWriter(os.path.join(workdir, "metrics.jsonl"))])
