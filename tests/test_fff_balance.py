"""FFF routing balance (train/tracking/sparse_stats.py, interp/usage.py): Gini per level and over leaves, leftmost-leaf
share, left turns; a balanced tree scores 0 at every depth, an unbalanced one matches a hand computation."""

import numpy as np
import pytest
from conftest import layer_model_config

from sparsetx.interp import circuits, usage
from sparsetx.train.tracking import sparse_stats


def balanced_paths(depth: int, n_trees: int):
  """Every leaf of every tree reached by exactly one token: paths [tokens=2**depth, trees, depth+1] (heap order)."""
  leaves = np.arange(2**depth)
  nodes = [np.zeros_like(leaves)]
  for level in range(depth):
    bit = (leaves >> (depth - 1 - level)) & 1  # 0: left (2n+1), 1: right (2n+2)
    nodes.append(2 * nodes[-1] + 1 + bit)
  path_TL = np.stack(nodes, -1)
  return np.broadcast_to(path_TL[:, None, :], (len(leaves), n_trees, depth + 1))


# One tree of depth 2, 4 tokens: all go left at the root, then 3 left, 1 right: visits [4, 4, 0, 3, 1, 0, 0].
SKEWED_PATHS = np.array([[0, 1, 3], [0, 1, 3], [0, 1, 3], [0, 1, 4]])[:, None, :]
SKEWED = dict(
  gini=20 / 32,  # leaves [3, 1, 0, 0]: sum |xi - xj| over ordered pairs / (2 n^2 mean) = 20 / (2 * 16 * 1)
  gini_level_1=8 / 16,  # [4, 0]: 8 / (2 * 4 * 2)
  gini_level_2=20 / 32,
  leftmost_leaf_share=3 / 4,
  left_turns=7 / 8,  # 4 left turns at the root, 3 of 4 at node 1
)


def train_stats(path_TPL, depth, n_trees):
  """The trainer's per-layer statistics from a sown path (batch of one row)."""
  ffn = layer_model_config("fff", depth=depth, n_trees=n_trees).ffn
  path_BTPL = np.asarray(path_TPL, np.int32)[None]
  stats = sparse_stats.layer_stats(ffn, {"path_nodes": (path_BTPL,)}, np.ones(path_BTPL.shape[:2], np.float32))
  return {name: float(value) for name, value in stats.items()}


def database_stats(path_TPL, depth, n_trees):
  """interp/usage.py's statistics of the same paths recorded in a circuit database."""
  cfg = layer_model_config("fff", depth=depth, n_trees=n_trees)
  n_nodes = 2 ** (depth + 1) - 1
  ids_NS = (np.asarray(path_TPL) + n_nodes * np.arange(n_trees)[:, None]).reshape(len(path_TPL), -1)
  N = len(ids_NS)
  db = circuits.CircuitDatabase(
    tokens_N=np.zeros(N, np.int32),
    context_NW=np.zeros((N, 1), np.int32),
    top5_N5=np.zeros((N, 5), np.int32),
    ids_LNS=ids_NS[None],
    weights_LNS=np.ones((1,) + ids_NS.shape, np.float32),
    ffn_type="fff",
    layers_L=np.array([0]),
  )
  (row,) = usage.fff_balance_table(cfg, db)
  (usage_row,) = usage.usage_table(cfg, db)
  assert usage_row["gini"] == row["gini"]  # the usage table's Gini is the leaves' one for FFF
  return row


@pytest.mark.parametrize("depth", [1, 4, 7])
def test_a_balanced_tree_scores_zero_at_every_depth(depth):
  for stats in (train_stats(balanced_paths(depth, 3), depth, 3), database_stats(balanced_paths(depth, 3), depth, 3)):
    assert stats["gini"] == pytest.approx(0.0, abs=1e-6)
    for level in range(1, depth + 1):
      assert stats[f"gini_level_{level}"] == pytest.approx(0.0, abs=1e-6)
    assert stats["leftmost_leaf_share"] == pytest.approx(2.0**-depth)
    assert stats["left_turns"] == pytest.approx(0.5)


def test_a_skewed_tree_matches_the_hand_computation():
  trained = train_stats(SKEWED_PATHS, 2, 1)
  recorded = database_stats(SKEWED_PATHS, 2, 1)
  for name, value in SKEWED.items():
    assert trained[name] == pytest.approx(value, rel=1e-6), name
    assert recorded[name] == pytest.approx(value, rel=1e-6), name
  assert trained["used"] == pytest.approx(4 / 7)  # nodes 0, 1, 3, 4 of 7
