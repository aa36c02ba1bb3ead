"""sgatlin circuits: the gate vector is the layer (rebuild formula), and patching it is an exact do-intervention."""

import numpy as np
import pytest
import seqio
from interp_cases import parallel_sgatlin, parallel_sgatlin_trace, tokens

from sparsetx.interp import Patch, nie
from sparsetx.interp.circuits import rebuild_sgatlin_output

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
  return parallel_sgatlin()


@pytest.fixture(scope="module")
def clean():
  return parallel_sgatlin_trace()


def experts(model, layer):
  return np.asarray(model.params[f"layers_{layer}"]["mlp"]["experts"])


def test_gate_indices_in_range_and_gate_vector_holds_the_scores(model, clean):
  ffn = model.cfg.ffn
  for layer in range(model.cfg.n_layers):
    idx = np.asarray(clean[f"layers[{layer}].mlp.gate_indices"])
    scores = np.asarray(clean[f"layers[{layer}].mlp.gate_scores"])
    vector = np.asarray(clean[f"layers[{layer}].mlp.gate_vector"])
    assert idx.shape == scores.shape == (2, 12, ffn.n_channels, ffn.top_k)
    assert idx.min() >= 0 and idx.max() < ffn.d_ffw
    assert (np.diff(np.sort(idx, -1), axis=-1) > 0).all()  # k distinct neurons per channel
    assert (np.diff(scores, axis=-1) <= 0).all()  # top-k order
    np.testing.assert_array_equal(np.take_along_axis(vector, idx, -1), scores)
    assert ((vector != 0).sum(-1) == ffn.top_k).all()


def test_layer_output_rebuilds_from_gate_vector_tables_and_input(model, clean):
  for layer in range(model.cfg.n_layers):
    name = lambda n, layer=layer: f"layers[{layer}].{n}"
    rebuilt = rebuild_sgatlin_output(clean[name("mlp.gate_vector")], experts(model, layer), clean[name("mlp_input")])
    np.testing.assert_allclose(rebuilt, clean[name("mlp.mlp_output")], **TOL)
    block = clean[name("layer_input")] + clean[name("self_attn.attention_output")] + rebuilt
    np.testing.assert_allclose(block, clean[name("layer_output")], **TOL)


def test_counterfactual_gates_change_the_layer_output_as_the_formula_predicts(model, clean):
  other, layer, positions = tokens(seed=7), 1, [4, 9]
  gates = [f"layers[{layer}].mlp.gate_indices", f"layers[{layer}].mlp.gate_scores"]
  theirs = model.trace(other, model.names)
  patched = model.patch(tokens(), {name: Patch(theirs[name], positions) for name in gates}, model.names)
  at = np.zeros((1, 12, 1, 1), bool)
  at[:, positions] = True
  mixed = np.where(at, theirs[f"layers[{layer}].mlp.gate_vector"], clean[f"layers[{layer}].mlp.gate_vector"])
  np.testing.assert_array_equal(patched[f"layers[{layer}].mlp.gate_vector"], mixed)
  np.testing.assert_allclose(patched[f"layers[{layer}].mlp_input"], clean[f"layers[{layer}].mlp_input"], **TOL)
  predicted = rebuild_sgatlin_output(mixed, experts(model, layer), clean[f"layers[{layer}].mlp_input"])
  np.testing.assert_allclose(patched[f"layers[{layer}].mlp.mlp_output"], predicted, **TOL)
  changed = np.abs(
    np.asarray(patched[f"layers[{layer}].mlp.mlp_output"]) - clean[f"layers[{layer}].mlp.mlp_output"]
  ).max(-1)
  assert (changed[:, positions] > 1e-3).all() and (changed[:, [0, 5, 11]] < 1e-5).all()


@pytest.fixture(scope="module")
def pairs():
  return nie.fact_pairs(seqio.ByteVocabulary())


def test_fact_pairs_align_positions_and_differ_in_target(pairs):
  assert len(pairs.nouns) == 80 and all(a != b for a, b in pairs.nouns)
  assert (pairs.y_clean_B != pairs.y_patch_B).all()
  vocabulary = seqio.ByteVocabulary()
  for b, (noun, _) in enumerate(pairs.nouns[:5]):
    real = pairs.segment_ids_BT[b] > 0
    assert vocabulary.decode(pairs.clean_BT[b, real][1:].tolist()) == f"The {noun} was "
    assert vocabulary.decode(pairs.clean_BT[b, pairs.masks["noun_first"][b]].tolist()) == noun[0]
    assert vocabulary.decode(pairs.clean_BT[b, pairs.masks["noun_last"][b]].tolist()) == noun[-1]
  t = np.arange(pairs.clean_BT.shape[1])
  first, last = pairs.masks["noun_first"].argmax(1)[:, None], pairs.masks["noun_last"].argmax(1)[:, None]
  assert ((pairs.clean_BT != pairs.patch_BT) <= ((t >= first) & (t <= last))).all()  # only the nouns differ


def test_nie_is_zero_when_the_clean_run_is_patched_with_its_own_gates(model, pairs):
  counterfactual = nie.run(model, pairs, min_effect=1e-3)
  assert counterfactual.kept_B.sum() > 40
  assert counterfactual.nie_RC.shape == (model.cfg.n_layers + 1, len(nie.POSITION_SETS))
  assert np.isfinite(counterfactual.nie_RC).all() and np.abs(counterfactual.nie_RC[-1, -1]) > 1e-3  # the gates matter
  own = nie.run(model, pairs, min_effect=1e-3, source_gates=counterfactual.clean_gates)
  np.testing.assert_array_equal(own.m_clean_B, counterfactual.m_clean_B)
  np.testing.assert_array_equal(own.nie_RC, 0.0)
