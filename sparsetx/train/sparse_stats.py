"""Per-layer usage statistics of the sparse feed-forward layers, from the circuits they tap.

More: docs/modules.md, sparsetx/train/sparse_stats.py.
"""

import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx.models.ffn.common import gini
from sparsetx.models.ffn.registry import SPECS


def usage_counts(ids, weights_per_id, size: int):
  """How often each of `size` units was picked: a weighted bincount."""
  return jnp.zeros((size,), jnp.float32).at[ids.reshape(-1)].add(weights_per_id.reshape(-1))


def layer_stats(ffn_cfg, taps: dict, token_weights_BT) -> dict:
  """used and gini over the layer's usage space (FfnSpec.circuit), then the type's own (FfnSpec.usage_stats)."""
  spec = SPECS.get(ffn_cfg.type)
  if spec is None or spec.circuit is None:
    return {}
  circuit = spec.circuit
  units = taps[circuit.units][0]
  ids_BTS = circuit.usage_ids(ffn_cfg, circuit.ids(ffn_cfg, units, jnp))
  size = circuit.usage_units(ffn_cfg)
  w_BTS = jnp.broadcast_to(token_weights_BT.reshape(token_weights_BT.shape + (1,)), ids_BTS.shape)
  counts = usage_counts(ids_BTS, w_BTS, size)
  stats = dict(used=(counts > 0).mean(), gini=gini(counts))
  if spec.usage_stats is not None:
    stats.update(spec.usage_stats(ffn_cfg, counts, taps, token_weights_BT))
  return stats


def sparse_stats(model_cfg, intermediates: dict, token_weights_BT) -> dict:
  """{'sparse/layers_i/<stat>': value} for every layer of a sparse feed-forward type."""
  stats = {}
  for i in range(model_cfg.n_layers):
    taps = intermediates.get(f"layers_{i}", {}).get("mlp", {})
    for name, value in layer_stats(config_lib.layer_ffn_config(model_cfg, i), taps, token_weights_BT).items():
      stats[f"sparse/layers_{i}/{name}"] = value
  return stats
