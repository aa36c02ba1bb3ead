"""Standard names, trace and patch on small random models: the nnterp identities and every name's layout."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from interp_cases import B, T, model_config, parallel_sgatlin, parallel_sgatlin_trace, tokens

from sparsetx import config as config_lib
from sparsetx.interp import FromRun, Patch, StandardizedTransformer, layout_shape
from sparsetx.interp import names as names_lib
from sparsetx.models.transformer import Transformer


def assert_same(actual, desired, err_msg=""):
  """Integers (indices, paths) exactly; floats up to the reassociation XLA may choose when a program
  also outputs intermediates (a few float32 ulps)."""
  actual, desired = np.asarray(actual), np.asarray(desired)
  if np.issubdtype(desired.dtype, np.integer):
    np.testing.assert_array_equal(actual, desired, err_msg=err_msg)
  else:
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-6, err_msg=err_msg)


@pytest.fixture(scope="module")
def sgatlin():
  return parallel_sgatlin()


@pytest.fixture(scope="module")
def clean():
  return parallel_sgatlin_trace()


@pytest.mark.parametrize("ffn_type", config_lib.FFN_TYPES)
def test_every_name_is_served_with_its_layout(ffn_type):
  for block, norm in (("sequential", "rmsnorm"), ("parallel", "layernorm")):
    cfg = model_config(ffn_type, block=block, norm=norm)
    abstract_params = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens()))["params"]
    model = StandardizedTransformer(cfg, abstract_params)
    shapes = model.eval_shapes(B, T)
    expected = {
      names_lib.full_name(entry, layer)
      for entry in names_lib.REGISTRY
      if names_lib.served(entry, cfg)
      for layer in ([None] if entry.scope == "model" else range(cfg.n_layers))
    }
    assert set(shapes) == expected == set(model.names)
    for name, shape in shapes.items():
      assert shape.shape == layout_shape(name, cfg, B, T), name
    for entry in names_lib.REGISTRY:  # the others are refused with the reason
      if not names_lib.served(entry, cfg):
        with pytest.raises(KeyError, match="exists only for"):
          model.resolve(names_lib.full_name(entry, 0))


def test_tracing_does_not_change_logits(sgatlin, clean):
  plain = jax.jit(sgatlin.model.apply)({"params": sgatlin.params}, tokens())
  assert_same(clean["logits"], plain)
  assert_same(clean["lm_head_output"], plain)


def test_patching_a_value_with_itself_is_a_no_op(sgatlin, clean):
  patchable = [name for name in sgatlin.names if sgatlin.resolve(name).entry.patchable]
  assert "layers[1].mlp.gate_scores" in patchable and "layers[0].self_attn.attention_probabilities" in patchable
  whole = sgatlin.patch(tokens(), {name: clean[name] for name in patchable}, sgatlin.names)
  for name in sgatlin.names:
    assert_same(whole[name], clean[name], err_msg=name)


def test_patches_from_functions_and_other_runs(sgatlin, clean):
  other = tokens(seed=2)
  name, downstream = "layers[0].mlp.mlp_output", "layers[1].layer_input"
  doubled = sgatlin.patch(tokens(), {name: lambda v: 2 * v}, sgatlin.names)
  np.testing.assert_allclose(doubled[name], 2 * clean[name], rtol=1e-6)
  assert not np.allclose(doubled["logits"], clean["logits"])
  theirs = sgatlin.trace(other, sgatlin.names)[name]
  taken = sgatlin.patch(tokens(), {name: Patch(FromRun(other), positions=[5])}, sgatlin.names)
  np.testing.assert_array_equal(taken[name][:, 5], theirs[:, 5])
  assert_same(taken[name][:, :5], clean[name][:, :5])
  # causal: positions before the patched one are unchanged downstream, the patched one is not
  assert_same(taken[downstream][:, :5], clean[downstream][:, :5])
  assert not np.allclose(taken[downstream][:, 5], clean[downstream][:, 5])


def test_project_on_vocab_of_the_last_layer_is_logits_and_probs_sum_to_one(sgatlin, clean):
  np.testing.assert_allclose(
    sgatlin.project_on_vocab(clean["layers[1].layer_output"]), clean["logits"], rtol=1e-6, atol=1e-6
  )
  probs = np.asarray(clean["next_token_probs"], np.float64)
  assert probs.shape == (B, 512) and (probs >= 0).all()
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(probs, np.asarray(jax.nn.softmax(clean["logits"][:, -1])), rtol=1e-6)


def test_parallel_block_identity(sgatlin, clean):
  assert sgatlin.cfg.block == "parallel"
  for layer in range(sgatlin.cfg.n_layers):
    names = [
      f"layers[{layer}].{n}" for n in ("layer_input", "self_attn.attention_output", "mlp.mlp_output", "layer_output")
    ]
    x, attn, mlp, y = (np.asarray(clean[n]) for n in names)
    np.testing.assert_allclose(x + attn + mlp, y, rtol=1e-5, atol=1e-6)
  # a parallel block's MLP never sees its own attention
  ablated = sgatlin.patch(tokens(), {names[1]: np.zeros_like(attn)}, sgatlin.names)
  assert_same(ablated["layers[1].mlp_input"], clean["layers[1].mlp_input"])
  assert not np.allclose(ablated["layers[1].layer_output"], clean["layers[1].layer_output"])


def test_bad_names_and_read_only_values_are_refused(sgatlin):
  with pytest.raises(KeyError, match="not a standard name"):
    sgatlin.trace(tokens(), ["layers[0].nonsense"])
  with pytest.raises(KeyError, match="write it as 'layers\\[0\\].mlp.mlp_output'"):
    sgatlin.trace(tokens(), ["layers[0].mlp_output"])
  with pytest.raises(KeyError, match="layers 0..1"):
    sgatlin.trace(tokens(), ["layers[2].layer_output"])
  with pytest.raises(ValueError, match="read-only"):
    sgatlin.patch(tokens(), {"layers[0].mlp.gate_vector": np.zeros((B, T, 4, 1024))})


def test_printout_lists_modules_with_names_and_layouts(sgatlin):
  text = str(sgatlin)
  assert text.startswith("Transformer(ffn=sgatlin, block=parallel")
  assert "(0-1): 2 x Block(" in text and "(mlp): Sgatlin(experts(2, 4, 1024, 32))" in text
  for entry in names_lib.REGISTRY:
    if names_lib.served(entry, sgatlin.cfg):
      assert f"({entry.name}) -> {entry.layout}: {entry.meaning}" in text
  assert "path_nodes" not in text
