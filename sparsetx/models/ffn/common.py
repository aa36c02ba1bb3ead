"""Pieces every feed-forward layer shares: initializers with logical axis names, activations."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.config import SGATLIN_ACTIVATIONS
from sparsetx.kernels.rows import reference
from sparsetx.kernels.rows.reference import gelu, gelu_tanh, identity  # noqa: F401 (the layers import them here)


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


# config.model.ffn.activation's values (exact GELU; the kernels' own identity, so the gated gather knows it is
# linear in the gate), from the kernels' table of the activations a layer hands them
ACTIVATIONS = {name: reference.ACTIVATIONS[name] for name in SGATLIN_ACTIVATIONS}

# `config.model.ffn.gelu_approximate` = None (the default, and what a config saved before the field reads
# as) takes the form each layer's source code uses: PEER and sgatlin's GELU ablation call `jax.nn.gelu`
# with its default tanh approximation; FFF (paper, UltraFastBERT) uses the exact erf GELU. The dense MLP
# stays exact (GPT-NeoX / Pythia, HF's "gelu").
OFFICIAL_GELU_APPROXIMATE = {"sgatlin": True, "peer": True, "fff": False}


def gelu_approximate(ffn) -> bool:
  """Whether this feed-forward config's GELU is the tanh approximation (see OFFICIAL_GELU_APPROXIMATE)."""
  choice = ffn.get("gelu_approximate", None)
  return OFFICIAL_GELU_APPROXIMATE.get(ffn.type, False) if choice is None else bool(choice)


def gelu_for(ffn):
  return gelu_tanh if gelu_approximate(ffn) else gelu


def activation_for(ffn):
  """sgatlin's ablation activation (`ffn.activation`), its GELU in the form `gelu_approximate` picks."""
  return gelu_for(ffn) if ffn.activation == "gelu" else ACTIVATIONS[ffn.activation]


def gini(counts):
  """Gini coefficient of non-negative counts along the last axis (0 = uniform, 1 = one unit takes everything)."""
  x = jnp.sort(counts.astype(jnp.float32), axis=-1)
  n = x.shape[-1]
  ranks = jnp.arange(1, n + 1, dtype=jnp.float32)
  total = jnp.maximum(x.sum(-1), 1e-9)
  return (2.0 * (ranks * x).sum(-1) / (n * total)) - (n + 1.0) / n
