"""sgatlin and PEER layers (router included) against their authors' code, transcribed in tests/official_refs.py."""

import jax
import jax.numpy as jnp
import numpy as np
import official_refs as official
import pytest
from conftest import init_params, layer_model_config

from sparsetx.models.ffn.common import gelu
from sparsetx.models.ffn.peer import Peer
from sparsetx.models.ffn.sgatlin import Sgatlin


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
  [
    (64, 1, 1, 8, "identity"),
    (256, 4, 8, 16, "identity"),
    (144, 3, 5, 8, "relu"),
    (64, 2, 4, 8, "swish"),
    (64, 2, 3, 8, "gelu"),
  ],
)
def test_sgatlin_equals_listing_1(d_ffw, n_channels, top_k, d_key, activation):
  """The paper's layer (identity) and its Table 1 ablations, act(g * <w_in, x>) with tanh GELU."""
  cfg = layer_model_config(
    "sgatlin", d_model=24, d_ffw=d_ffw, n_channels=n_channels, top_k=top_k, d_key=d_key, activation=activation
  )
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model))
  layer = Sgatlin(cfg)
  params = init_params(layer, x)
  assert params["experts"].shape == (2, n_channels, d_ffw, cfg.d_model)
  act = official.ACTIVATIONS[activation]
  assert_layer_matches(layer, lambda p, x: official.sgatlin(p, x, top_k, act), x, params)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_sgatlin_with_peer_router_equals_listing_1(activation):
  cfg = layer_model_config(
    "sgatlin", d_model=16, d_ffw=64, n_channels=2, top_k=3, d_key=8, router="peer", activation=activation
  )
  x = jax.random.normal(jax.random.key(2), (2, 4, cfg.d_model))
  layer = Sgatlin(cfg)
  params = init_params(layer, x)
  act = official.ACTIVATIONS[activation]
  assert_layer_matches(layer, lambda p, x: official.sgatlin_peer_router(p, x, cfg.ffn.top_k, act), x, params)


@pytest.mark.parametrize("d_ffw, n_channels, top_k, gelu_approximate", [(64, 2, 4, None), (256, 4, 8, False)])
def test_peer_equals_its_code(d_ffw, n_channels, top_k, gelu_approximate):
  """softmax(scores) * gelu(<w_in, x>): tanh GELU by default (PEER's code), exact erf when asked."""
  cfg = layer_model_config(
    "peer", d_model=16, d_ffw=d_ffw, n_channels=n_channels, top_k=top_k, d_key=8, gelu_approximate=gelu_approximate
  )
  x = jax.random.normal(jax.random.key(3), (2, 4, cfg.d_model))
  layer = Peer(cfg)
  params = init_params(layer, x)
  assert params["experts"].shape == (2, d_ffw, cfg.d_model)
  act = official.OFFICIAL_GELU if gelu_approximate is None else gelu
  assert_layer_matches(layer, lambda p, x: official.peer(p, x, top_k, act), x, params)


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
