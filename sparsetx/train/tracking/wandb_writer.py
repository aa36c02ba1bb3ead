"""Weights & Biases beside TensorBoard and metrics.jsonl: config.metrics.wandb, `pip install 'sparsetx[wandb]'`.

Process 0 only, as the other writers. The W&B run's id is kept in <workdir>/wandb_run_id, so every later start in
the workdir (a restart, a rollback) continues the same W&B run. W&B keeps a run's steps increasing: the steps a
resume redoes, which the earlier start had logged, are kept by metrics.jsonl and TensorBoard (they rewrite them),
not by W&B. A workdir on gs:// keeps the id there and W&B's local files under WANDB_DIR (or the current directory).
"""

import secrets

import numpy as np
from absl import logging
from etils import epath

from sparsetx import paths
from sparsetx.config import ConfigError
from sparsetx.train.tracking import scalars_only

RUN_ID = "wandb_run_id"


def run_id(workdir: epath.Path) -> str:
  """The workdir's W&B run id: the one an earlier start kept, or a new one, kept now."""
  path = workdir / RUN_ID
  if path.exists():
    return path.read_text(encoding="utf-8").strip()
  new = secrets.token_hex(4)
  paths.write_text_atomically(path, new + "\n")
  return new


class WandbWriter(scalars_only.ScalarsOnly):
  """clu's writer interface over one W&B run; `settings` is config.metrics.wandb."""

  def __init__(self, settings, workdir: epath.Path):
    import wandb  # noqa: PLC0415  (an optional extra; config validation said how to install it)

    try:
      self._run = wandb.init(
        project=settings.project,
        entity=settings.entity or None,
        name=settings.name or None,
        mode=settings.mode or "online",
        id=run_id(workdir),
        resume=None if settings.mode == "offline" else "allow",  # offline ignores it, with a warning
        dir=None if paths.is_remote(workdir) else str(workdir),
        # The console stays the trainer's (its log is in the workdir); quiet: no run summary of its own at the end.
        settings=wandb.Settings(console="off", quiet=True),
      )
    except (wandb.Error, OSError) as error:
      raise ConfigError(
        f"Weights & Biases could not start the run ({error}): log in (`wandb login` or WANDB_API_KEY), or log "
        "offline with --config.metrics.wandb.mode=offline and `wandb sync` later."
      ) from error
    self._logged = self._run.step  # a resumed online run: the steps W&B has already (offline: 0)
    self._said = False

  def write_scalars(self, step, scalars):
    if step < self._logged:
      if not self._said:
        logging.info("W&B holds this run's steps up to %d already; redone steps before it are not sent.", self._logged)
        self._said = True
      return
    self._run.log({name: float(value) for name, value in scalars.items()}, step=int(step))

  def write_histograms(self, step, arrays, num_buckets=None):
    import wandb  # noqa: PLC0415

    if step >= self._logged:
      histograms = {
        name: wandb.Histogram(np_histogram=np.histogram(np.asarray(values), bins=num_buckets or 64))
        for name, values in arrays.items()
      }
      self._run.log(histograms, step=int(step))

  def write_hparams(self, hparams):
    self._run.config.update(dict(hparams), allow_val_change=True)

  def close(self):
    self._run.finish()
