"""The decoder: causality, document isolation under packing, the parallel block's residual sum."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import load_config

from sparsetx import config as config_lib
from sparsetx.models.transformer import Transformer, apply_rotary, block_config, checkpoint_policy


def small_model(ffn_type="sgatlin", **model):
  config = load_config("configs/tiny.py", ffn_type)
  config.model.update(dict(n_layers=2, dtype="float32", max_len=32), **model)
  config.data.seq_len = 32
  config_lib.validate(config)
  return Transformer(ml_collections.FrozenConfigDict(config.model))


def init(model, tokens):
  return nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))


@pytest.mark.parametrize("ffn_type", config_lib.FFN_TYPES)
@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_logits_do_not_see_the_future(ffn_type, block):
  model = small_model(ffn_type, n_layers=1, block=block, norm="rmsnorm" if block == "sequential" else "layernorm")
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 259)
  variables = init(model, tokens)
  t = 9
  changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 17) % 259)
  apply = jax.jit(model.apply)
  before, after = apply(variables, tokens), apply(variables, changed)
  assert before.dtype == jnp.float32 and before.shape == (2, 16, 512)
  np.testing.assert_array_equal(before[:, : t + 1], after[:, : t + 1])
  assert not np.allclose(before[:, t + 1 :], after[:, t + 1 :])


def test_packed_documents_do_not_attend_across():
  model = small_model("mlp")
  doc_a = jax.random.randint(jax.random.key(2), (1, 10), 0, 259)
  doc_b = jax.random.randint(jax.random.key(3), (1, 6), 0, 259)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.array([[1] * 10 + [2] * 6])
  positions = jnp.array([list(range(10)) + list(range(6))])
  variables = init(model, packed)
  apply = jax.jit(model.apply)
  logits_packed = apply(variables, packed, positions, segments)
  np.testing.assert_allclose(logits_packed[:, 10:], apply(variables, doc_b), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits_packed[:, :10], apply(variables, doc_a), rtol=1e-5, atol=1e-5)


def test_parallel_block_adds_attention_and_mlp_to_its_input():
  config = load_config("configs/pythia.py")
  config.model.update(vocab_size=512, d_model=128, n_layers=2, max_len=16, dtype="float32")
  model = Transformer(ml_collections.FrozenConfigDict(config.model))
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 512)
  variables = init(model, tokens)
  assert "bias" in variables["params"]["layers_0"]["mlp_norm"]  # LayerNorm with bias
  _, state = model.apply(variables, tokens, mutable=["intermediates"])
  for i in range(2):
    values = {k: v[0] for k, v in state["intermediates"][f"layers_{i}"].items() if isinstance(v, tuple)}
    np.testing.assert_allclose(
      values["layer_input"] + values["attention_output"] + values["mlp_output"],
      values["layer_output"],
      rtol=1e-6,
      atol=1e-6,
    )
    # Both branches read the block input: the MLP's input is the LayerNorm of layer_input.
    ln = variables["params"][f"layers_{i}"]["mlp_norm"]
    x = values["layer_input"]
    normed = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * ln["scale"][None, None] + ln[
      "bias"
    ][None, None]
    np.testing.assert_allclose(values["mlp_input"], normed, rtol=1e-4, atol=1e-4)


def test_bf16_compute_keeps_float32_params_and_logits():
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, 259)
  model = small_model("mlp", dtype="bfloat16")
  variables = init(model, tokens)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))
  _, state = model.apply(variables, tokens, mutable=["intermediates"])
  assert state["intermediates"]["layers_0"]["mlp_input"][0].dtype == jnp.bfloat16
  assert state["intermediates"]["layers_0"]["attention"]["attention_probabilities"][0].dtype == jnp.float32
  assert model.apply(variables, tokens).dtype == jnp.float32


@pytest.mark.parametrize("policy", [True, *config_lib.REMAT_POLICIES[1:]])
def test_remat_changes_neither_loss_nor_gradients(policy):
  """Every policy (and a saved config's remat=True) recomputes the same float32 values: equal up to rounding."""
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, 259)
  plain = small_model("mlp")
  config = load_config("configs/tiny.py", "mlp")
  config.model.update(n_layers=2, dtype="float32", max_len=32)
  model = config.model.to_dict()
  model["remat"] = policy  # a plain dict: a saved config's bool passes as it would from JSON
  remat = Transformer(ml_collections.FrozenConfigDict(model))
  variables = init(plain, tokens)
  loss = lambda m: jax.jit(jax.value_and_grad(lambda v: m.apply(v, tokens).mean()))  # noqa: E731
  (value_plain, grads_plain), (value_remat, grads_remat) = loss(plain)(variables), loss(remat)(variables)
  np.testing.assert_allclose(value_plain, value_remat, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_plain), jax.tree.leaves(grads_remat)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: remat.apply(v, tokens).mean()))(variables))
  assert "remat" in jaxpr or "checkpoint" in jaxpr  # the blocks really are rematerialized


@pytest.mark.parametrize("policy", config_lib.REMAT_POLICIES[2:])
def test_remat_policies_are_jax_checkpoint_policies(policy):
  assert callable(checkpoint_policy(policy))  # save_routing and save_dots: the project's names (transformer.py)


def test_unknown_remat_policy_is_refused_with_the_valid_names():
  config = load_config("configs/tiny.py", "mlp")
  config.model.remat = "dots"
  with pytest.raises(
    config_lib.ConfigError, match=r"config\.model\.remat='dots' is unknown; use one of 'none', 'full'"
  ):
    config_lib.validate(config)


def test_tied_embeddings_share_the_table():
  model = small_model("mlp", tie_embeddings=True)
  tokens = jnp.arange(8)[None]
  variables = init(model, tokens)
  assert "lm_head" not in variables["params"]
  _, state = model.apply(variables, tokens, mutable=["intermediates"])
  final = state["intermediates"]["final_norm_output"][0]
  np.testing.assert_allclose(
    model.apply(variables, tokens), final @ variables["params"]["embed"]["embedding"].T, rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("fraction, rotated", [(1.0, 8), (0.25, 2), (0.0, 0)])
def test_rotary_rotates_only_its_fraction_and_preserves_norm(fraction, rotated):
  x = jax.random.normal(jax.random.key(6), (1, 5, 2, 8))
  positions = jnp.arange(5)[None] + 3
  y = apply_rotary(x, positions, int(8 * fraction), 10_000.0)
  np.testing.assert_array_equal(y[..., rotated:], x[..., rotated:])
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  # Relative: <rot(q, m), rot(k, n)> depends only on m - n.
  q, k = x[:, :1], x[:, 1:2]
  dot = lambda m, n: jnp.sum(
    apply_rotary(q, jnp.array([[m]]), rotated, 1e4) * apply_rotary(k, jnp.array([[n]]), rotated, 1e4)
  )  # noqa: E731
  np.testing.assert_allclose(dot(7, 3), dot(14, 10), rtol=1e-5)


def test_block_config_of_a_dense_layer_leaves_the_model_config_unchanged():
  cfg = config_lib.default_config().model
  cfg.ffn_layers = "1"
  frozen = ml_collections.FrozenConfigDict(cfg)
  before = frozen.to_dict()
  assert block_config(frozen, 0).ffn.type == frozen.dense_ffn.type
  assert block_config(frozen, 1).ffn.type == frozen.ffn.type
  assert frozen.to_dict() == before and ml_collections.FrozenConfigDict(frozen).ffn.type == cfg.ffn.type
