"""Pieces every feed-forward layer shares: initializers with logical axis names, activations."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def dense_init(std: float, names: tuple):
  """Normal(std) kernel init carrying the logical axis names used for sharding."""
  return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def router_init(names: tuple):
  """LeCun normal (fan-in over the contracted axes), as nn.Dense uses in the papers' listings."""
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


def symmetric_uniform(limit: float):
  """Uniform in [-limit, limit] (UltraFastBERT's FFF node initialization)."""

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, minval=-limit, maxval=limit)

  return init


def gelu(x):
  """Exact (erf) GELU, as in GPT-NeoX and the FFF paper."""
  return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {
    "identity": lambda x: x,
    "relu": jax.nn.relu,
    "gelu": gelu,
    "swish": jax.nn.silu,
}
