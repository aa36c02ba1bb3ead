"""Per-layer usage statistics of the sparse feed-forward layers, from the circuits they tap.

More: docs/modules.md, sparsetx/train/tracking/sparse_stats.py.
"""

import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx.models.ffn.common import gini
from sparsetx.models.ffn.registry import SPECS
from sparsetx.train.tracking import usage_window


def usage_counts(ids, weights_per_id, size: int):
  """How often each of `size` units was picked: a weighted bincount."""
  return jnp.zeros((size,), jnp.float32).at[ids.reshape(-1)].add(weights_per_id.reshape(-1))


def layer_counts(ffn_cfg, taps: dict, token_weights_BT):
  """How often the real tokens picked each unit of the layer's usage space (FfnSpec.circuit); None for a layer
  that taps no circuit."""
  spec = SPECS.get(ffn_cfg.type)
  if spec is None or spec.circuit is None:
    return None
  circuit = spec.circuit
  ids_BTS = circuit.usage_ids(ffn_cfg, circuit.ids(ffn_cfg, taps[circuit.units][0], jnp))
  w_BTS = jnp.broadcast_to(token_weights_BT.reshape(token_weights_BT.shape + (1,)), ids_BTS.shape)
  return usage_counts(ids_BTS, w_BTS, circuit.usage_units(ffn_cfg))


def layer_stats(ffn_cfg, taps: dict, token_weights_BT, counts=None) -> dict:
  """used and gini over the layer's usage space (FfnSpec.circuit), then the type's own (FfnSpec.usage_stats)."""
  counts = layer_counts(ffn_cfg, taps, token_weights_BT) if counts is None else counts
  if counts is None:
    return {}
  stats = dict(used=(counts > 0).mean(), gini=gini(counts))
  spec = SPECS[ffn_cfg.type]
  if spec.usage_stats is not None:
    stats.update(spec.usage_stats(ffn_cfg, counts, taps, token_weights_BT))
  return stats


def sparse_stats(model_cfg, intermediates: dict, token_weights_BT) -> dict:
  """{'sparse/layers_i/<stat>': value} for every layer of a sparse feed-forward type, and each one's counts
  ('usage_counts/layers_i': the step adds them to the window's, usage_window.py)."""
  stats = {}
  for i in range(model_cfg.n_layers):
    taps = intermediates.get(f"layers_{i}", {}).get("mlp", {})
    ffn_cfg = config_lib.layer_ffn_config(model_cfg, i)
    counts = layer_counts(ffn_cfg, taps, token_weights_BT)
    if counts is None:
      continue
    stats[f"{usage_window.COUNTS}layers_{i}"] = counts
    for name, value in layer_stats(ffn_cfg, taps, token_weights_BT, counts).items():
      stats[f"sparse/layers_{i}/{name}"] = value
  return stats
