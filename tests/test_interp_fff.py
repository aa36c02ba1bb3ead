"""FFF circuits: the recorded path is the path the sparse layer walked; pruning removes whole subtrees exactly."""

import numpy as np
import pytest
from interp_cases import random_model, tokens, validation_rows

from sparsetx.interp import circuits, pruning, usage


@pytest.fixture(scope="module")
def model():
  return random_model("fff", ffn=(("depth", 6),), n_layers=1)  # deep trees: some leaves unvisited


@pytest.fixture(scope="module")
def rows():
  return validation_rows()


def walk(x_ND, w_in_PND, b_in_PN, depth):
  """The tree walk in float64 numpy: the reference path [N,P,L] and node logits."""
  N, P = x_ND.shape[0], w_in_PND.shape[0]
  node, path, logits = np.zeros((N, P), np.int64), [], []
  for _ in range(depth + 1):
    z = np.einsum("nd,npd->np", x_ND, w_in_PND[np.arange(P), node]) + b_in_PN[np.arange(P), node]
    path.append(node)
    logits.append(z)
    node = np.where(z > 0, 2 * node + 2, 2 * node + 1)
  return np.stack(path, -1), np.stack(logits, -1)


def test_recorded_path_is_the_path_the_sparse_layer_computed(model):
  assert model.cfg.ffn.implementation == "sparse"
  out = model.trace(tokens(), model.names)
  for layer in range(model.cfg.n_layers):
    params = model.params[f"layers_{layer}"]["mlp"]
    x = np.asarray(out[f"layers[{layer}].mlp_input"], np.float64).reshape(-1, model.cfg.d_model)
    path, z = walk(
      x, np.asarray(params["w_in"], np.float64), np.asarray(params["b_in"], np.float64), model.cfg.ffn.depth
    )
    recorded = np.asarray(out[f"layers[{layer}].mlp.path_nodes"]).reshape(path.shape)
    np.testing.assert_array_equal(recorded, path)
    np.testing.assert_allclose(
      np.asarray(out[f"layers[{layer}].mlp.node_logits"]).reshape(z.shape), z, rtol=1e-4, atol=1e-5
    )
    assert len(np.unique(path[..., -1])) > 1  # tokens reach different leaves


def test_pruning_nothing_changes_nothing_and_pruning_removes_whole_subtrees(model, rows):
  db = circuits.record(model, rows)
  assert len(db) == int(rows["loss_weights"].sum())
  visits, leaves = usage.fff_visits(model.cfg, db, 0)
  np.testing.assert_allclose(visits[:, 0], 1.0)  # every token visits every root
  np.testing.assert_allclose(leaves.sum(-1), 1.0)  # and exactly one leaf per tree
  for row in usage.fff_path_table(model.cfg, db):
    assert 1 <= row["paths_used"] <= row["paths"] == 64 and 0 <= row["entropy_bits"] <= 6 + 1e-9
  assert not pruning.pruned_nodes(visits, 0.0).any()
  unpruned = pruning.validation_loss(model, model.params, rows)
  results = pruning.sweep(model, db, rows, fractions=(0.0, 0.5))
  assert results[0]["pruned_nodes"] == 0 and results[0]["loss"] == unpruned
  same = pruning.prune_params(model.params, {0: pruning.pruned_nodes(visits, 0.0)})
  for a, b in zip(np.asarray(same["layers_0"]["mlp"]["w_out"]), np.asarray(model.params["layers_0"]["mlp"]["w_out"])):
    np.testing.assert_array_equal(a, b)
  P, N = visits.shape
  assert results[1]["pruned_nodes"] == model.cfg.n_layers * round(0.5 * P * N) and results[1]["loss"] != unpruned
  mask = pruning.pruned_nodes(visits, 0.5)
  children = np.arange(N // 2)
  assert (mask[:, 2 * children + 1] >= mask[:, children]).all() and (
    mask[:, 2 * children + 2] >= mask[:, children]
  ).all()


def test_pruning_only_unvisited_nodes_leaves_the_loss_on_those_rows_unchanged(model, rows):
  db = circuits.record(model, rows)
  masks = {layer: usage.fff_visits(model.cfg, db, layer)[0] == 0 for layer in range(model.cfg.n_layers)}
  assert sum(m.sum() for m in masks.values()) > 0
  pruned = pruning.prune_params(model.params, masks)
  assert pruning.validation_loss(model, pruned, rows) == pruning.validation_loss(model, model.params, rows)
