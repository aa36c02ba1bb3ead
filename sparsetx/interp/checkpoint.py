"""A trained model for analysis: its config and params from a workdir, its vocabulary, prompts and
validation rows, all on one device (interpretability runs are small and need no mesh).

Prompts follow the training convention of the packed inputs: a row starts with id 0 (the
decoder's shifted-in start token), then the text's ids. With the default byte vocabulary a word is
several tokens (one per byte + 3).
"""

import ml_collections
import numpy as np

from sparsetx.data import global_stream, pretokenize, vocab
from sparsetx.interp.trace import StandardizedTransformer
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing

START_ID = 0


def load(workdir: str, step: int | None = None):
  """(config, StandardizedTransformer, step) of the checkpoint at `step` (default: the latest), on one device."""

  def float32(config):
    config.model.dtype = "float32"  # analysis compares values exactly; compute-only, the params are float32

  config, params, step = checkpointing.load(workdir, step, adjust=float32)
  config = pretokenize.train_corpus(config, workdir)  # the run's corpus (a run saved without one: written now)
  return config, StandardizedTransformer(config.model, params), step


def vocabulary(config: ml_collections.ConfigDict):
  return vocab.make_vocabulary(config.data, config.model.vocab_size)


def encode_prompt(vocabulary, text: str) -> list[int]:
  return [START_ID] + list(vocabulary.encode(text))


def token_text(vocabulary, token_id: int) -> str:
  """One token for a table cell, whitespace made visible."""
  if token_id == START_ID:
    return "<s>"
  text = vocabulary.decode([int(token_id)])
  return text.replace(" ", "␣").replace("\n", "⏎") or f"<{int(token_id)}>"


def validation_rows(config: ml_collections.ConfigDict, max_rows: int, task: str | None = None) -> dict:
  """Up to `max_rows` packed validation rows (numpy: inputs, targets, positions, segment_ids,
  loss_weights) from the mixture's tasks in order, or from `task` only; padding rows dropped."""
  mesh = state_lib.single_device_mesh(config)
  data = global_stream.TokenizedEvalData(config, mesh_lib.batch_sharding(mesh, config.mesh.rules), "validation")
  rows = {}
  for name in [task] if task else data.task_names:
    for batch in data.local_batches(name):
      for key, value in batch.items():
        rows.setdefault(key, []).append(value)
  rows = {key: np.concatenate(values) for key, values in rows.items()}
  real = rows["loss_weights"].sum(1) > 0
  return {key: value[real][:max_rows] for key, value in rows.items()}
