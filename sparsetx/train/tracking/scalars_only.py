"""The base of the writers that keep scalars only (metrics.jsonl, W&B): every other kind of write is dropped.

Its own module so that metrics.py and the optional W&B writer both build on it without importing each other.
"""

from clu.metric_writers import interface


class ScalarsOnly(interface.MetricWriter):
  """A writer of scalars that takes every other kind of write and drops it (metrics.jsonl, W&B's base)."""

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
    pass

  def close(self):
    pass
