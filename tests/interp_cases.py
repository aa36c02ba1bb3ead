"""Shared small models for the interpretability tests, built once per worker (init compiles take seconds).

The sgatlin model uses the parallel (GPT-NeoX) block with LayerNorm and biases, so the same model
serves the parallel-block identity and the sgatlin circuit tests; the sequential block is covered
by the trained checkpoint of tests/test_interp_tool.py.
"""

import functools

import jax
import ml_collections
import numpy as np
from conftest import init_params, load_config

from sparsetx import config as config_lib
from sparsetx.interp import StandardizedTransformer
from sparsetx.models.transformer import Transformer

B, T = 2, 12


def model_config(ffn_type="sgatlin", ffn=(), **model):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(dict(d_model=32, head_dim=16, n_layers=2, dtype="float32", max_len=32), **model)
  config.model.ffn.update(dict(ffn))
  config.data.seq_len = 32
  config_lib.validate(config)
  return ml_collections.FrozenConfigDict(config.model)


def tokens(seed=1, batch=B, length=T):
  return np.asarray(jax.random.randint(jax.random.key(seed), (batch, length), 3, 259))


@functools.cache
def validation_rows():
  """Four rows of 32 tokens as checkpoint.validation_rows gives them, the first with a padded tail."""
  inputs = tokens(seed=3, batch=4, length=32)
  weights = np.ones(inputs.shape, np.float32)
  weights[0, 20:] = 0.0  # a padded tail is not recorded
  return dict(
    inputs=inputs,
    targets=np.roll(inputs, -1, axis=1),
    positions=np.broadcast_to(np.arange(32), inputs.shape),
    segment_ids=np.ones_like(inputs),
    loss_weights=weights,
  )


def random_model(ffn_type: str, ffn: tuple = (), **model) -> StandardizedTransformer:
  """`ffn`: (field, value) pairs for config.model.ffn (a tuple, so the model can be cached)."""
  cfg = model_config(ffn_type, ffn, **model)
  return StandardizedTransformer(cfg, init_params(Transformer(cfg), tokens()))


def parallel_sgatlin() -> StandardizedTransformer:
  return random_model("sgatlin", block="parallel", norm="layernorm", use_bias=True)


@functools.cache
def parallel_sgatlin_trace() -> dict:
  """Every served value of `parallel_sgatlin()` on `tokens()`: one compiled trace shared by the test files."""
  model = parallel_sgatlin()
  return model.trace(tokens(), model.names)
