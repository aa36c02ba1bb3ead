"""FFF pruning after training: remove the least visited nodes and measure validation loss
(the FFF paper's static pruning of the least used tree nodes, Appendix G.5).

More: docs/modules.md, sparsetx/interp/pruning.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsetx.interp import circuits as circuits_lib
from sparsetx.interp import usage
from sparsetx.models.ffn.registry import SPECS
from sparsetx.models.transformer import Transformer


def node_level(n_nodes: int) -> np.ndarray:
  """Depth of each heap index: floor(log2(n + 1))."""
  return np.floor(np.log2(np.arange(n_nodes) + 1)).astype(np.int32)


def pruned_nodes(visits_PN: np.ndarray, fraction: float) -> np.ndarray:
  """Boolean [P, N]: the round(fraction * P * N) least visited nodes of a layer (deepest first on ties)."""
  P, N = visits_PN.shape
  count = int(round(fraction * P * N))
  levels = np.broadcast_to(node_level(N), (P, N)).reshape(-1)
  order = np.lexsort((np.arange(P * N), -levels, visits_PN.reshape(-1)))  # last key sorts first
  mask = np.zeros(P * N, bool)
  mask[order[:count]] = True
  return mask.reshape(P, N)


def prune_params(params, masks_by_layer: dict):
  """A copy of params with w_in, b_in, w_out zeroed at the pruned nodes ({layer: mask [P, N]})."""
  params = jax.tree.map(lambda x: x, params)  # new containers; untouched leaves are shared
  for layer, mask_PN in masks_by_layer.items():
    mlp = dict(params[f"layers_{layer}"]["mlp"])
    keep_PN = jnp.asarray(~mask_PN)
    mlp["w_in"] = mlp["w_in"] * keep_PN[..., None].astype(mlp["w_in"].dtype)
    mlp["b_in"] = mlp["b_in"] * keep_PN.astype(mlp["b_in"].dtype)
    mlp["w_out"] = mlp["w_out"] * keep_PN[..., None].astype(mlp["w_out"].dtype)
    params[f"layers_{layer}"] = {**params[f"layers_{layer}"], "mlp": mlp}
  return params


@functools.partial(jax.jit, static_argnums=0)
def _loss_sums(cfg, params, rows):
  logits = Transformer(cfg).apply({"params": params}, rows["inputs"], rows["positions"], rows["segment_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, rows["targets"])
  return (ce * rows["loss_weights"]).sum(), rows["loss_weights"].sum()


def validation_loss(model, params, rows: dict, batch_rows: int = 32) -> float:
  """Mean next-token loss over the real tokens of `rows` with `params` (same jitted program for any params)."""
  total, tokens = 0.0, 0.0
  for start in range(0, len(rows["inputs"]), batch_rows):
    batch = {k: jnp.asarray(v[start : start + batch_rows]) for k, v in rows.items()}
    loss_sum, weight_sum = _loss_sums(model.cfg, params, batch)
    total, tokens = total + float(loss_sum), tokens + float(weight_sum)
  return total / max(tokens, 1.0)


def sweep(model, db: circuits_lib.CircuitDatabase, rows: dict, fractions=(0.0, 0.1, 0.25, 0.5, 0.75)) -> list[dict]:
  """Validation loss against the pruned fraction of every FFF layer's nodes (visits from `db`; a mixed model's
  dense layers are left as they are)."""
  cfg = model.cfg
  circuit = SPECS[cfg.ffn.type].circuit
  if circuit is None or not circuit.tree_paths:  # FfnSpec.circuit.tree_paths: nodes of binary trees (FFF)
    raise ValueError(f"pruning removes FFF nodes; this model's config.model.ffn.type is {cfg.ffn.type!r}.")
  visits = {layer: usage.fff_visits(cfg, db, layer)[0] for layer in db.layers_L.tolist()}
  results = []
  for fraction in fractions:
    masks = {layer: pruned_nodes(v, fraction) for layer, v in visits.items()}
    params = prune_params(model.params, masks)
    results.append(
      dict(
        fraction=float(fraction),
        pruned_nodes=int(sum(m.sum() for m in masks.values())),
        visits_removed=float(
          np.mean([v[m].sum() / max(v.sum(), 1e-12) for v, m in zip(visits.values(), masks.values())])
        ),
        loss=validation_loss(model, params, rows),
      )
    )
  return results
