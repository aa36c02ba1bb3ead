"""Ahead-of-time lowering of the sampler's cached decoding for an accelerator this machine does not have
(tests/test_lowering.py); the train and eval steps lower in sparsetx/measure/aot.py."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from sparsetx.evaluate import sampling
from sparsetx.measure.aot import on_topology
from sparsetx.train import state as state_lib


def lower_generate(
  config: ml_collections.ConfigDict,
  topology_name: str,
  batch_size: int = 8,
  prefill_len: int | None = None,
) -> str:
  """StableHLO text of the sampler's cached generation (a prefill of `prefill_len` tokens, then one decode step
  per new token reading the KV cache) for `batch_size` rows of config.model.max_len, lowered like
  sparsetx.measure.aot.lower_train_step."""
  model = state_lib.build_model(config)
  B, T = batch_size, config.model.max_len
  prefill_len = prefill_len or sampling.prefill_length(T // 2, T)
  with on_topology(topology_name):
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32)))["params"])
    spec = jax.ShapeDtypeStruct
    args = (
      params,
      spec((B, T), jnp.int32),
      spec((B,), jnp.int32),
      spec((B,), jnp.bool_),
      spec((), jnp.int32),
      spec((), jnp.float32),
      spec((), jnp.int32),
      jax.eval_shape(jax.random.key, 0),
    )
    jitted = jax.jit(functools.partial(sampling.generate_cached, model), static_argnums=(0, 1))
    return jitted.trace(0, prefill_len, *args).lower().as_text()
