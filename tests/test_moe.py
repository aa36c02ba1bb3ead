"""MoE dispatch (sorted grouped matmuls) equals running every expert on every token and masking."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import init_params, layer_model_config

from sparsetx import config as config_lib
from sparsetx.models.ffn.moe import Moe, balance_losses
from sparsetx.models.transformer import Transformer
from sparsetx.train import step as step_lib


def moe_reference(params, x_BTD, ffn):
  logits_BTE = x_BTD @ params["router"]["kernel"] + params["router"]["bias"][None, None, :]
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


def switch_losses_by_hand(logits_NE, ids_NK, weights_N):
  """Switch Transformer eq. 4-6 (f_i over the routed (token, slot) pairs, P_i the mean router probability) and
  ST-MoE's z-loss, in float64 over the tokens with weight > 0, one loop per token."""
  n_experts = logits_NE.shape[1]
  real = [n for n in range(len(weights_N)) if weights_N[n] > 0]
  f = np.zeros(n_experts)
  p = np.zeros(n_experts)
  z = 0.0
  for n in real:
    for e in ids_NK[n]:
      f[e] += 1.0
    shifted = logits_NE[n] - logits_NE[n].max()
    p += np.exp(shifted) / np.exp(shifted).sum()
    z += (logits_NE[n].max() + np.log(np.exp(shifted).sum())) ** 2
  f /= f.sum()
  p /= len(real)
  return n_experts * float(np.sum(f * p)), z / len(real)


def test_balancing_losses_equal_a_hand_computation():
  """N * sum_i f_i P_i and mean(logsumexp(logits)**2) over real tokens; padding (weight 0) left out."""
  k = jax.random.split(jax.random.key(0), 2)
  logits_BTE = 3.0 * jax.random.normal(k[0], (2, 5, 6))
  _, ids_BTK = jax.lax.top_k(logits_BTE, 2)
  weights_BT = jnp.ones((2, 5)).at[1, 3:].set(0.0)
  got = balance_losses(6, logits_BTE, ids_BTK, weights_BT)
  aux, z = switch_losses_by_hand(
    np.asarray(logits_BTE, np.float64).reshape(10, 6),
    np.asarray(ids_BTK).reshape(10, 2),
    np.asarray(weights_BT).reshape(10),
  )
  np.testing.assert_allclose(float(got["aux_loss"]), aux, rtol=1e-6)
  np.testing.assert_allclose(float(got["router_z_loss"]), z, rtol=1e-6)


def moe_model_config(aux_loss, router_z_loss=0.0):
  config = config_lib.default_config()
  config.model.update(d_model=16, head_dim=16, n_layers=1, vocab_size=32, dtype="float32")
  config.model.ffn.update(
    type="moe", d_ffw=8, n_experts=4, experts_per_token=1, aux_loss=aux_loss, router_z_loss=router_z_loss
  )
  config_lib.validate_model(config.model)
  return config


def moe_batch(seed=0, B=4, T=16):
  tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, 32)
  return dict(
    inputs=tokens[:, :-1],
    targets=tokens[:, 1:],
    positions=jnp.tile(jnp.arange(T)[None, :], (B, 1)),
    segment_ids=jnp.ones((B, T), jnp.int32),
    loss_weights=jnp.ones((B, T)).at[0, 10:].set(0.0),
  )


def skewed_params(model, batch):
  """Router scaled up (tokens differ in their logits) and biased toward expert 0: nearly all tokens go there."""
  params = nn.unbox(model.init(jax.random.key(0), batch["inputs"], batch["positions"], batch["segment_ids"])["params"])
  router = params["layers_0"]["mlp"]["router"]
  router["kernel"] = router["kernel"] * 50
  router["bias"] = router["bias"].at[0].set(6.0)
  return params


def test_balancing_losses_enter_the_training_loss_with_their_weights():
  """loss(aux_loss=a, router_z_loss=b) - loss(0, 0) = a * aux + b * z, the values the metrics report."""
  batch = moe_batch()
  plain, weighted = moe_model_config(0.0), moe_model_config(0.5, 0.01)
  model = Transformer(ml_collections.FrozenConfigDict(plain.model))
  params = skewed_params(model, batch)
  run = lambda config: jax.jit(
    functools.partial(  # noqa: E731
      step_lib.loss_and_grads,
      model=Transformer(ml_collections.FrozenConfigDict(config.model)),
      train=config.train,
    )
  )(params, batch)
  loss0, *_ = run(plain)
  loss1, _, _, stats = run(weighted)
  aux, z = stats["sparse/layers_0/aux_loss"], stats["sparse/layers_0/router_z_loss"]
  assert aux > 2.0  # skewed: far from the balanced value 1
  np.testing.assert_allclose(float(loss1 - loss0), float(0.5 * aux + 0.01 * z), rtol=1e-4)


def test_training_with_the_balancing_loss_lowers_max_load():
  """Six SGD steps (lr 0.1) of the training loss with aux_loss=1 spread a router that starts with one expert
  taking almost every token (max_load 3.1 -> 1.2 here); the same steps without it leave the skew (-> 2.8)."""
  batch = moe_batch()
  loads = {}
  for aux_loss in (0.0, 1.0):
    config = moe_model_config(aux_loss)
    model = Transformer(ml_collections.FrozenConfigDict(config.model))
    params = skewed_params(model, batch)
    optimizer = optax.sgd(0.1)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
      _, grads, _, stats = step_lib.loss_and_grads(params, batch, model=model, train=config.train)
      updates, state = optimizer.update(grads, state)
      return optax.apply_updates(params, updates), state, stats["sparse/layers_0/max_load"]

    history = []
    for _ in range(6):
      params, state, max_load = step(params, state)
      history.append(float(max_load))
    loads[aux_loss] = history
  assert loads[1.0][0] > 3.0 and loads[0.0][0] > 3.0  # 4 = every token on one expert of 4
  assert loads[1.0][-1] < 2.0 < loads[0.0][-1], {k: [round(v, 2) for v in h] for k, h in loads.items()}
