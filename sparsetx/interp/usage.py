"""Unit usage over a circuit database: how much of a sparse layer is used, how evenly, and which units
fire together.

More: docs/modules.md, sparsetx/interp/usage.py.
"""

import numpy as np

from sparsetx.interp import circuits as circuits_lib
from sparsetx.models.ffn import common, fff


def gini(counts: np.ndarray) -> float:
  """The trainer's Gini coefficient (models.ffn.common.gini) of a 1-D count vector, as a Python float."""
  return float(common.gini(np.asarray(counts)))


def unit_ids(cfg, db: circuits_lib.CircuitDatabase, layer: int):
  """(ids [N, S] in usage space, number of units). The circuit's flat space, except PEER, whose
  channels share one table: there a unit is a neuron, whichever channel picked it."""
  circuit = circuits_lib.circuit_of(cfg)
  return circuit.usage_ids(cfg.ffn, db.ids(layer)), circuit.usage_units(cfg.ffn)


def unit_counts(cfg, db: circuits_lib.CircuitDatabase, layer: int) -> np.ndarray:
  """How many times recorded tokens picked each unit of the layer."""
  ids, size = unit_ids(cfg, db, layer)
  return np.bincount(ids.reshape(-1), minlength=size)


def usage_table(cfg, db: circuits_lib.CircuitDatabase) -> list[dict]:
  """Per sparse layer: units, fraction used at least once, Gini, and the busiest unit's share of tokens."""
  rows = []
  for layer in db.layers_L.tolist():
    counts = unit_counts(cfg, db, layer)
    spread = fff_balance(cfg, db, layer)["gini"] if circuits_lib.circuit_of(cfg).tree_paths else gini(counts)
    rows.append(
      dict(
        layer=layer,
        units=len(counts),
        used=float((counts > 0).mean()),
        gini=spread,
        top_unit_share=float(counts.max() / max(len(db), 1)),
      )
    )
  return rows


def fff_balance(cfg, db: circuits_lib.CircuitDatabase, layer: int) -> dict:
  """Gini over the leaves and per level, leftmost-leaf share and fraction of left turns of one FFF layer."""
  counts_PN = unit_counts(cfg, db, layer).reshape(cfg.ffn.n_trees, fff.n_nodes(cfg.ffn.depth))
  return {name: float(value) for name, value in fff.fff_balance(counts_PN).items()}


def fff_balance_table(cfg, db: circuits_lib.CircuitDatabase) -> list[dict]:
  """One row of fff_balance per layer (balanced routing: every Gini 0, left turns 0.5, leftmost 2**-depth)."""
  return [dict(layer=layer, **fff_balance(cfg, db, layer)) for layer in db.layers_L.tolist()]


def coactivation(cfg, db: circuits_lib.CircuitDatabase, layer: int, top: int = 64):
  """(units [M], counts [M, M], lift [M, M]) among the `top` most used units of a layer."""
  counts = unit_counts(cfg, db, layer)
  units = np.argsort(-counts, kind="stable")[:top]
  position = np.full(len(counts), -1)
  position[units] = np.arange(len(units))
  hits_NS = position[unit_ids(cfg, db, layer)[0]]
  onehot_NM = np.zeros((len(db), len(units)), np.float32)
  rows, slots = np.nonzero(hits_NS >= 0)
  onehot_NM[rows, hits_NS[rows, slots]] = 1.0  # a unit picked twice by one token (PEER) counts once
  together_MM = onehot_NM.T @ onehot_NM
  p_M = np.diag(together_MM) / max(len(db), 1)
  lift_MM = (together_MM / max(len(db), 1)) / np.maximum(np.outer(p_M, p_M), 1e-12)
  return units, together_MM, lift_MM


def top_pairs(cfg, db: circuits_lib.CircuitDatabase, layer: int, top: int = 64, n_pairs: int = 10, min_count: int = 5):
  """The most co-activated pairs (by lift, at least `min_count` shared tokens) as dicts."""
  units, together, lift = coactivation(cfg, db, layer, top)
  i, j = np.triu_indices(len(units), k=1)
  keep = together[i, j] >= min_count
  order = np.argsort(-lift[i, j][keep], kind="stable")[:n_pairs]
  return [
    dict(unit_a=int(units[a]), unit_b=int(units[b]), together=int(together[a, b]), lift=float(lift[a, b]))
    for a, b in zip(i[keep][order], j[keep][order])
  ]


def fff_path_table(cfg, db: circuits_lib.CircuitDatabase, top: int = 3) -> list[dict]:
  """Per layer and tree: leaves (paths) reached at least once, path entropy in bits (max = depth), and
  the most taken paths with their share of tokens."""
  rows = []
  for layer in db.layers_L.tolist():
    _, leaves_PL = fff_visits(cfg, db, layer)
    for tree, share in enumerate(leaves_PL):
      p = share[share > 0]
      best = np.argsort(-share, kind="stable")[:top]
      rows.append(
        dict(
          layer=layer,
          tree=tree,
          paths_used=int((share > 0).sum()),
          paths=len(share),
          entropy_bits=float(-(p * np.log2(p)).sum()),
          top_paths=", ".join(f"leaf {i}: {share[i]:.2f}" for i in best),
        )
      )
  return rows


def fff_visits(cfg, db: circuits_lib.CircuitDatabase, layer: int):
  """(node visit frequency [P, n_nodes], leaf (path) frequency [P, 2**D]): fraction of tokens."""
  n_nodes = fff.n_nodes(cfg.ffn.depth)
  node_PN = unit_counts(cfg, db, layer).reshape(cfg.ffn.n_trees, n_nodes) / max(len(db), 1)
  return node_PN, node_PN[:, n_nodes // 2 :]
