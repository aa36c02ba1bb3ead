"""Export kind 'custom': sparse models run in PyTorch through the bundled modeling file, and import back exactly.

Parameters are random (not the init: nonzero biases, norm scales away from 1) so every term of the
forward shows up in the logits; transformers loads the directory with trust_remote_code and its
float32 logits must match the JAX model's within 1e-4.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from export_checks import assert_same_export, random_params
from test_train import micro_config

from sparsetx import config as config_lib
from sparsetx.config import ConfigError
from sparsetx.hf import custom, export
from sparsetx.models.transformer import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# name -> (ffn type, model overrides, ffn overrides); shapes are micro_config's (tiny's ffn, d_model 64, 2 layers).
CASES = {
  "sgatlin": ("sgatlin", {}, {}),
  "sgatlin_peer_router_gelu": ("sgatlin", dict(tie_embeddings=True), dict(router="peer", activation="gelu")),
  "fff": ("fff", dict(block="parallel", norm="layernorm", use_bias=True, rotary_fraction=0.25), {}),
  # mixed models (sparsetx/tools/sparsify.py): the layers ffn_layers leaves out keep dense_ffn (mlp, swiglu here)
  "fff_post_after_mlp": (
    "fff",
    dict(tie_embeddings=True, ffn_layers="1", use_bias=True),
    dict(variant="fff_post", implementation="masked_dense"),
  ),
  "moe_before_swiglu": (
    "moe",
    dict(block="parallel", rotary_fraction=0.5, ffn_layers="0", dense_ffn=dict(type="swiglu", d_ffw=96)),
    {},
  ),
  "peer": ("peer", dict(norm="layernorm"), {}),
}


def case_config(name: str, **model) -> ml_collections.ConfigDict:
  """The full (training) config of a case; export writes its model and its byte vocabulary's tokenizer files."""
  ffn_type, model_overrides, ffn_overrides = CASES[name]
  config = micro_config(ffn_type)
  config.model.update(model_overrides, **model)
  config.model.ffn.update(ffn_overrides)
  return config


def assert_same_tree(expected, actual):
  assert jax.tree.structure(expected) == jax.tree.structure(actual)
  for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    assert e.dtype == a.dtype and e.shape == a.shape
    assert np.array_equal(np.asarray(e).view(np.uint8), np.asarray(a).view(np.uint8))  # bit for bit


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_logits_match_jax(case, tmp_path):
  full_config = case_config(case)
  config = full_config.model
  params = random_params(config)
  tokens_BT = np.random.default_rng(1).integers(0, config.vocab_size, (2, config.max_len)).astype(np.int32)
  apply = jax.jit(Transformer(ml_collections.FrozenConfigDict(config)).apply)
  expected_BTV = np.asarray(apply({"params": params}, tokens_BT))

  assert export.write_hf(full_config, params, str(tmp_path / "hf")) == "hf_custom"
  assert {os.path.basename(f) for f in custom.MODELING_FILES} <= set(os.listdir(tmp_path / "hf"))
  # transformers loads the sharded export, whose tensors are the unsharded one's bit for bit
  cap = os.path.getsize(tmp_path / "hf" / "model.safetensors") // 5
  export.write_hf(full_config, params, str(tmp_path / "sharded"), max_shard_size=cap)
  assert_same_export(tmp_path / "hf", tmp_path / "sharded", shards=3)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / "sharded", trust_remote_code=True, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
  layer_types = [config_lib.layer_ffn_config(config, i).type for i in range(config.n_layers)]
  assert [type(layer.mlp).__name__.lower() for layer in model.model.layers] == layer_types
  with torch.no_grad():
    logits_BTV = model(torch.as_tensor(tokens_BT, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits_BTV, expected_BTV, rtol=0, atol=1e-4)

  imported_config, imported = export.load_hf(str(tmp_path / "hf"))
  assert imported_config.model.to_dict() == config.to_dict()
  assert_same_tree(params, imported)


def test_left_padding_matches_the_unpadded_row(tmp_path):
  """attention_mask hides padding and positions restart at the first real token, as in a packed sparsetx row."""
  config = case_config("sgatlin")
  export.write_hf(config, random_params(config.model), str(tmp_path / "hf"))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
  row = torch.as_tensor(np.random.default_rng(2).integers(2, config.model.vocab_size, (1, 12)), dtype=torch.long)
  padded = torch.cat([torch.zeros((1, 4), dtype=torch.long), row], dim=1)
  mask = torch.cat([torch.zeros((1, 4), dtype=torch.long), torch.ones_like(row)], dim=1)
  with torch.no_grad():
    np.testing.assert_allclose(
      model(padded, attention_mask=mask).logits[:, 4:].numpy(), model(row).logits.numpy(), rtol=0, atol=1e-5
    )


def test_bfloat16_params_round_trip_bit_identical():
  config = case_config("fff", param_dtype="bfloat16").model
  params = random_params(config, seed=3)
  config_json, tensors = custom.to_hf(config, params)
  assert all(t.dtype == np.float32 for t in tensors.values())
  assert config_json["auto_map"]["AutoModelForCausalLM"] == "modeling_sparsetx.SparsetxForCausalLM"
  assert (config_json["bos_token_id"], config_json["eos_token_id"], config_json["pad_token_id"]) == (0, 1, 0)
  model_config, imported = custom.from_hf(json.loads(json.dumps(config_json)), tensors)
  assert model_config.param_dtype == "bfloat16"
  assert_same_tree(params, imported)


def test_every_buildable_architecture_is_supported():
  for name in CASES:
    assert custom.unsupported_reason(case_config(name).model) is None
  broken = case_config("sgatlin").model
  broken.ffn.d_ffw = 1000
  assert "perfect square" in custom.unsupported_reason(broken)


def test_import_refuses_tensors_of_another_model():
  config = case_config("fff").model
  config_json, tensors = custom.to_hf(config, random_params(config))
  wrong_shape = dict(tensors, **{"model.layers.0.mlp.w_in": tensors["model.layers.0.mlp.w_in"][:, :-1]})
  with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.w_in.*has shape"):
    custom.from_hf(config_json, wrong_shape)
  missing = {k: v for k, v in tensors.items() if k != "model.final_norm.scale"}
  with pytest.raises(ConfigError, match=r"missing \['model\.final_norm\.scale'\]"):
    custom.from_hf(config_json, missing)
  with pytest.raises(ConfigError, match="model_type='gpt_neox'"):
    custom.from_hf(dict(config_json, model_type="gpt_neox"), tensors)


def test_exported_router_breaks_exact_ties_like_the_jax_router():
  """The bundled PyTorch product-key top-k picks the same neurons as JAX's when sums tie exactly."""
  from sparsetx.hf.modeling import modeling_sparsetx
  from sparsetx.models.ffn.product_keys import product_key_top_k

  rng = np.random.default_rng(0)
  s1, s2 = (rng.integers(0, 4, (300, 12)).astype(np.float32) for _ in range(2))  # many exact ties
  values_t, ids_t = modeling_sparsetx.product_key_top_k(torch.from_numpy(s1), torch.from_numpy(s2), 4)
  values_j, ids_j = product_key_top_k(s1, s2, 4)
  np.testing.assert_array_equal(values_t.numpy(), np.asarray(values_j))
  np.testing.assert_array_equal(ids_t.numpy(), np.asarray(ids_j))
