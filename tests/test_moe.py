"""MoE dispatch (sorted grouped matmuls) equals running every expert on every token and masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, layer_model_config

from sparsetx.models.ffn.moe import Moe


def moe_reference(params, x_BTD, ffn):
  logits_BTE = x_BTD @ params["router"]["kernel"] + params["router"]["bias"]
  top_BTK, ids_BTK = jax.lax.top_k(logits_BTE, ffn.experts_per_token)
  weights_BTE = (jax.nn.one_hot(ids_BTK, ffn.n_experts) * jax.nn.softmax(top_BTK)[..., None]).sum(-2)
  gate_BTEF = jnp.einsum("btd,edf->btef", x_BTD, params["wi_gate"])
  up_BTEF = jnp.einsum("btd,edf->btef", x_BTD, params["wi_up"])
  every_expert_BTED = jnp.einsum("btef,efd->bted", jax.nn.silu(gate_BTEF) * up_BTEF, params["wo"])
  return jnp.einsum("bte,bted->btd", weights_BTE, every_expert_BTED)


@pytest.mark.parametrize("n_experts, experts_per_token", [(16, 2), (4, 1), (8, 3)])
def test_dispatch_equals_every_expert_reference(n_experts, experts_per_token):
  cfg = layer_model_config("moe", d_model=16, d_ffw=24, n_experts=n_experts, experts_per_token=experts_per_token)
  layer = Moe(cfg)
  x = jax.random.normal(jax.random.key(n_experts), (3, 10, 16))
  params = init_params(layer, x)
  params["router"]["kernel"] = params["router"]["kernel"] * 50  # spread tokens over many experts
  apply = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  reference = lambda p, x: moe_reference(p, x, cfg.ffn)  # noqa: E731
  np.testing.assert_allclose(jax.jit(apply)(params, x), jax.jit(reference)(params, x), rtol=1e-5, atol=1e-6)

  def grads(fn):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.cos(fn(p, x))), argnums=(0, 1)))(params, x)

  for (path, g), w in zip(jax.tree.leaves_with_path(grads(apply)), jax.tree.leaves(grads(reference))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_each_expert_sees_only_its_tokens():
  """An expert's weights get gradient iff some token was routed to it."""
  cfg = layer_model_config("moe", d_model=16, d_ffw=8, n_experts=16, experts_per_token=1)
  layer = Moe(cfg)
  x = jax.random.normal(jax.random.key(0), (1, 3, 16))  # 3 tokens: at most 3 of 16 experts used
  params = init_params(layer, x)
  (_, state), grads = jax.value_and_grad(
      lambda p: (lambda out: (jnp.sum(out[0]), out[1]))(layer.apply({"params": p}, x, mutable=["intermediates"])),
      has_aux=True,
  )(params)
  used = np.unique(np.asarray(state["intermediates"]["expert_ids"][0]))
  touched = np.flatnonzero(np.abs(np.asarray(grads["wi_up"])).sum(axis=(1, 2)) > 0)
  np.testing.assert_array_equal(touched, used)
