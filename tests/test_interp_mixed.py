"""Interpretability on a mixed model (config.model.ffn_layers): names, circuits, usage, neighbours, NIE and FFF
pruning read the sparse layers only, under the model's own layer index; a dense layer is refused by name."""

import jax
import numpy as np
import pytest
import seqio
from interp_cases import random_model, tokens, validation_rows

from sparsetx.config import ConfigError
from sparsetx.interp import circuits, layout_shape, neighbours, nie, pruning, usage
from sparsetx.interp.circuits import CircuitDatabase

DENSE_LAYER = "layer=0 is a dense layer \\('mlp', config.model.dense_ffn\\) of this mixed model"


@pytest.fixture(scope="module")
def model():
  """3 blocks: the dense MLP (d_ffw 784) in 0 and 2, sgatlin (d_ffw 1024) in 1."""
  return random_model("sgatlin", n_layers=3, ffn_layers="1")


@pytest.fixture(scope="module")
def rows():
  return validation_rows()


@pytest.fixture(scope="module")
def db(model, rows):
  return circuits.record(model, rows, batch_rows=4)


@pytest.fixture(scope="module")
def gates_NU(model, rows):
  """The sparse layer's gate vectors at the recorded tokens, traced directly: [N, C * d_ffw]."""
  out = model.trace(
    rows["inputs"], ["layers[1].mlp.gate_vector"], positions_BT=rows["positions"], segment_ids_BT=rows["segment_ids"]
  )
  vector_BTCN = np.asarray(out["layers[1].mlp.gate_vector"])
  return vector_BTCN[rows["loss_weights"] > 0].reshape(int(rows["loss_weights"].sum()), -1)


def test_each_layer_serves_the_names_of_its_own_feed_forward_type(model):
  names = set(model.names)
  assert {"layers[1].mlp.gate_indices", "layers[0].mlp.mlp_neurons", "layers[2].mlp.mlp_neurons"} <= names
  assert not {"layers[0].mlp.gate_indices", "layers[2].mlp.gate_vector", "layers[1].mlp.mlp_neurons"} & names
  for name, shape in model.eval_shapes(2, 12).items():
    assert shape.shape == layout_shape(name, model.cfg, 2, 12), name
  assert layout_shape("layers[0].mlp.mlp_neurons", model.cfg, 2, 12) == (2, 12, 784)
  assert layout_shape("layers[1].mlp.gate_vector", model.cfg, 2, 12) == (2, 12, 4, 1024)
  with pytest.raises(KeyError, match="layer 0 of this model is 'mlp'; this mixed model has 'sgatlin' in layers 1"):
    model.resolve("layers[0].mlp.gate_indices")


def test_printout_shows_each_block_with_its_own_feed_forward_layer(model):
  text = str(model)
  assert text.startswith("Transformer(ffn=sgatlin in layers 1, mlp in the others, block=sequential")
  blocks = text.split("Block(")[1:]
  assert [b.count("(mlp): Mlp(") for b in blocks] == [1, 0, 1] and "(mlp): Sgatlin(experts(2, 4, 1024, 32))" in blocks[
    1
  ]
  assert text.count("(gate_indices) ->") == 1 and text.count("(mlp_neurons) ->") == 2
  assert "    (0): Block(" in text and "    (1): Block(" in text and "    (2): Block(" in text


def test_database_holds_the_sparse_layer_and_its_traced_gate_vectors(model, db, gates_NU, tmp_path):
  assert circuits.sparse_layers(model.cfg) == (1,)
  assert db.layers_L.tolist() == [1] and db.ids_LNS.shape == (1, len(db), 4 * 8) and len(db) == len(gates_NU)
  recorded_NU = circuits.densify(model.cfg, db.ids(1), db.weights(1))
  np.testing.assert_array_equal(recorded_NU != 0, gates_NU != 0)
  np.testing.assert_allclose(recorded_NU, gates_NU, rtol=1e-5, atol=1e-6)
  db.save(str(tmp_path / "db.npz"))
  np.testing.assert_array_equal(CircuitDatabase.load(str(tmp_path / "db.npz")).layers_L, [1])
  old = {k: v for k, v in np.load(tmp_path / "db.npz").items() if k != "layers_L"}  # saved before mixed models
  np.savez(tmp_path / "old.npz", **old)
  np.testing.assert_array_equal(CircuitDatabase.load(str(tmp_path / "old.npz")).layers_L, [0])


def test_usage_of_the_sparse_layer_equals_counts_from_the_gate_vectors(model, db, gates_NU):
  assert ((gates_NU != 0).sum(1) == 4 * 8).all()  # k nonzero gates per channel: the support is the circuit
  counts_U = (gates_NU != 0).sum(0)
  np.testing.assert_array_equal(usage.unit_counts(model.cfg, db, 1), counts_U)
  (row,) = usage.usage_table(model.cfg, db)
  assert row["layer"] == 1 and row["units"] == 4 * 1024
  assert row["used"] == (counts_U > 0).mean() and row["gini"] == usage.gini(counts_U)
  assert row["top_unit_share"] == counts_U.max() / len(db)


def test_neighbours_at_the_sparse_layer_equal_brute_force_cosine_distances(model, db, rows, gates_NU):
  sentence = rows["inputs"][1, :12]
  found = neighbours.nearest(model, db, sentence, 1, k=5)
  assert found.layer == 1
  query_QU = gates_NU[20:32]  # row 0 records 20 tokens; row 1 starts with the sentence
  unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  distance_QN = 1.0 - unit(query_QU) @ unit(gates_NU).T
  np.testing.assert_allclose(found.distance_QK, np.sort(distance_QN, axis=1)[:, :5], atol=1e-5)
  np.testing.assert_allclose(found.distance_QK[:, 0], 0.0, atol=1e-5)  # each token finds its own circuit


def test_dense_layers_are_refused_naming_the_sparse_ones(model, db):
  cfg = model.cfg
  with pytest.raises(ConfigError, match=DENSE_LAYER + ".*use one of its sgatlin layers: 1\\."):
    circuits.circuit_names(cfg, 0)
  with pytest.raises(ConfigError, match="layer=2 is a dense layer"):
    neighbours.nearest(model, db, tokens()[0], 2)
  with pytest.raises(ConfigError, match="layer=2 is a dense layer"):
    nie.gate_names(cfg, 2)
  with pytest.raises(ConfigError, match="layer=3 is not a layer of this model; use one of its sgatlin layers: 1"):
    circuits.check_layer(cfg, 3)
  with pytest.raises(ConfigError, match="layer 0 has no circuits in this database; it holds layers 1"):
    usage.unit_counts(cfg, db, 0)


def test_nie_patches_the_sparse_layer_only(model):
  pairs = nie.fact_pairs(seqio.ByteVocabulary())
  result = nie.run(model, pairs, min_effect=1e-3)
  assert result.row_labels == ["1", "all"] and result.nie_RC.shape == (2, len(nie.POSITION_SETS))
  assert set(result.clean_gates) == {"layers[1].mlp.gate_indices", "layers[1].mlp.gate_scores"}
  assert np.isfinite(result.nie_RC).all() and np.abs(result.nie_RC[-1, -1]) > 1e-3
  np.testing.assert_array_equal(result.per_pair_RCB[0], result.per_pair_RCB[1])  # one sparse layer: it is "all"


def test_fff_pruning_touches_the_sparse_layer_only(rows):
  fff = random_model("fff", ffn=(("depth", 3),), n_layers=2, ffn_layers="1")
  db = circuits.record(fff, rows, batch_rows=4)
  visits_PN, _ = usage.fff_visits(fff.cfg, db, 1)
  np.testing.assert_allclose(visits_PN[:, 0], 1.0)  # every token visits every root
  assert [row["layer"] for row in usage.fff_path_table(fff.cfg, db)] == [1] * fff.cfg.ffn.n_trees
  results = pruning.sweep(fff, db, rows, fractions=(0.0, 0.5))
  assert results[0]["loss"] == pruning.validation_loss(fff, fff.params, rows)
  assert results[1]["pruned_nodes"] == round(0.5 * visits_PN.size) and results[1]["loss"] != results[0]["loss"]
  pruned = pruning.prune_params(fff.params, {1: pruning.pruned_nodes(visits_PN, 0.5)})
  kept, original = jax.tree.leaves(pruned["layers_0"]), jax.tree.leaves(fff.params["layers_0"])
  assert all(a is b for a, b in zip(kept, original))  # the dense layer is left as it is
  with pytest.raises(ConfigError, match="layer 0 has no circuits in this database"):
    usage.fff_visits(fff.cfg, db, 0)
