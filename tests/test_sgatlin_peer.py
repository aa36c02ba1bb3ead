"""sgatlin and PEER against dense references that build each channel's full sparse gate vector."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, layer_model_config

from sparsetx.models.ffn.common import ACTIVATIONS, gelu
from sparsetx.models.ffn.peer import Peer
from sparsetx.models.ffn.sgatlin import Sgatlin


def brute_force_gates(s1_NK, s2_NK, k):
  """Full sparse gate vectors g in R^(n_keys**2): top-k over all sums, zeros elsewhere."""
  sums = (s1_NK[..., :, None] + s2_NK[..., None, :]).reshape(s1_NK.shape[:-1] + (-1,))
  values, indices = jax.lax.top_k(sums, k)
  return (jax.nn.one_hot(indices, sums.shape[-1]) * values[..., None]).sum(-2)


def sgatlin_reference(params, x_BTD, ffn):
  """sum_c W_out_c^T diag(g_c) act(W_in_c z), with the shared-query product-key gate."""
  q = x_BTD @ params["router"]["query"]["kernel"]
  scores_BT2CN = jnp.einsum("btk,kscn->btscn", q, params["router"]["keys"]["kernel"])
  g_BTCF = brute_force_gates(scores_BT2CN[:, :, 0], scores_BT2CN[:, :, 1], ffn.top_k)
  w_in_CFD, w_out_CFD = params["experts"]
  h_BTCF = ACTIVATIONS[ffn.activation](jnp.einsum("btd,cfd->btcf", x_BTD, w_in_CFD))
  return jnp.einsum("btcf,btcf,cfd->btd", g_BTCF, h_BTCF, w_out_CFD)


def peer_reference(params, x_BTD, ffn, activation=gelu):
  """PEER: per-channel split query, softmax over each channel's k scores, one shared table."""
  q_BTC2H = jnp.einsum("btd,dcsh->btcsh", x_BTD, params["router"]["query"]["kernel"])
  s_BTC2N = jnp.einsum("btcsh,csnh->btcsn", q_BTC2H, params["router"]["sub_keys"])
  sums = (s_BTC2N[..., 0, :, None] + s_BTC2N[..., 1, None, :]).reshape(s_BTC2N.shape[:3] + (-1,))
  values, indices = jax.lax.top_k(sums, ffn.top_k)
  g_BTCF = (jax.nn.one_hot(indices, sums.shape[-1]) * jax.nn.softmax(values)[..., None]).sum(-2)
  w_in_FD, w_out_FD = params["experts"][0], params["experts"][1]
  h_BTF = activation(x_BTD @ w_in_FD.T)
  return jnp.einsum("btcf,btf,fd->btd", g_BTCF, h_BTF, w_out_FD)


def peer_router_reference(params, x_BTD, ffn, activation):
  """sgatlin with PEER's router: per-channel tables, softmax gates."""
  q_BTC2H = jnp.einsum("btd,dcsh->btcsh", x_BTD, params["router"]["query"]["kernel"])
  s_BTC2N = jnp.einsum("btcsh,csnh->btcsn", q_BTC2H, params["router"]["sub_keys"])
  sums = (s_BTC2N[..., 0, :, None] + s_BTC2N[..., 1, None, :]).reshape(s_BTC2N.shape[:3] + (-1,))
  values, indices = jax.lax.top_k(sums, ffn.top_k)
  g_BTCF = (jax.nn.one_hot(indices, sums.shape[-1]) * jax.nn.softmax(values)[..., None]).sum(-2)
  w_in_CFD, w_out_CFD = params["experts"]
  h_BTCF = activation(jnp.einsum("btd,cfd->btcf", x_BTD, w_in_CFD))
  return jnp.einsum("btcf,btcf,cfd->btd", g_BTCF, h_BTCF, w_out_CFD)


def assert_layer_matches(layer, reference, x_BTD, params):
  """Equal outputs, and equal gradients of a random projection of them, for params and input."""
  apply = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  y = jax.jit(apply)(params, x_BTD)
  np.testing.assert_allclose(y, jax.jit(reference)(params, x_BTD), rtol=2e-5, atol=2e-5)
  cotangent = jax.random.normal(jax.random.key(7), y.shape)

  def grads(fn):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x) * cotangent), argnums=(0, 1)))(params, x_BTD)

  got, want = grads(apply), grads(reference)
  flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves(want)
  for (path, g), w in zip(flat_got, flat_want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "d_ffw, n_channels, top_k, d_key, activation",
    [(64, 1, 1, 8, "identity"), (256, 4, 8, 16, "identity"), (144, 3, 5, 8, "identity"), (64, 2, 4, 8, "swish")],
)
def test_sgatlin_equals_dense_reference(d_ffw, n_channels, top_k, d_key, activation):
  cfg = layer_model_config(
      "sgatlin", d_model=24, d_ffw=d_ffw, n_channels=n_channels, top_k=top_k, d_key=d_key, activation=activation
  )
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))
  layer = Sgatlin(cfg)
  params = init_params(layer, x)
  assert params["experts"].shape == (2, n_channels, d_ffw, cfg.d_model)
  assert_layer_matches(layer, lambda p, x: sgatlin_reference(p, x, cfg.ffn), x, params)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_sgatlin_with_peer_router_equals_reference(activation):
  cfg = layer_model_config("sgatlin", d_model=16, d_ffw=64, n_channels=2, top_k=3, d_key=8, router="peer", activation=activation)
  x = jax.random.normal(jax.random.key(2), (2, 4, cfg.d_model))
  layer = Sgatlin(cfg)
  params = init_params(layer, x)
  assert_layer_matches(layer, lambda p, x: peer_router_reference(p, x, cfg.ffn, ACTIVATIONS[activation]), x, params)


@pytest.mark.parametrize("d_ffw, n_channels, top_k", [(64, 2, 4), (256, 4, 8)])
def test_peer_equals_dense_reference(d_ffw, n_channels, top_k):
  cfg = layer_model_config("peer", d_model=16, d_ffw=d_ffw, n_channels=n_channels, top_k=top_k, d_key=8)
  x = jax.random.normal(jax.random.key(3), (2, 4, cfg.d_model))
  layer = Peer(cfg)
  params = init_params(layer, x)
  assert params["experts"].shape == (2, d_ffw, cfg.d_model)
  assert_layer_matches(layer, lambda p, x: peer_reference(p, x, cfg.ffn), x, params)


def test_sgatlin_exposes_its_circuit_and_initialization():
  cfg = layer_model_config("sgatlin", d_model=64, d_ffw=1024, n_channels=4, top_k=8, d_key=32)
  x = jax.random.normal(jax.random.key(4), (3, 7, cfg.d_model))
  layer = Sgatlin(cfg)
  params = init_params(layer, x)
  _, state = layer.apply({"params": params}, x, mutable=["intermediates"])
  (idx,), (gates,) = state["intermediates"]["gate_indices"], state["intermediates"]["gate_scores"]
  assert idx.shape == gates.shape == (3, 7, 4, 8)
  assert gates.dtype == jnp.float32 and idx.min() >= 0 and idx.max() < 1024
  assert all(len(set(row)) == 8 for row in np.asarray(idx).reshape(-1, 8).tolist())  # k distinct neurons
  assert np.all(np.diff(np.asarray(gates), axis=-1) <= 0)  # raw scores, descending, no softmax
  np.testing.assert_allclose(np.std(params["experts"]), 1 / 32, rtol=0.05)  # truncated normal, std 1/sqrt(d_ffw)
  assert np.abs(params["experts"]).max() <= 2 / 32 / 0.87962566  # truncated at 2 std of the untruncated normal
