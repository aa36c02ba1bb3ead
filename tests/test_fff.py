"""FFF: the sparse path gather equals the masked-dense reference in values and in every gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params, layer_model_config

from sparsetx.models.ffn.fff import Fff, n_nodes, next_node


def fff_pair(depth, n_trees, variant, d_model=16):
  sparse = Fff(layer_model_config("fff", d_model=d_model, depth=depth, n_trees=n_trees, variant=variant))
  dense = Fff(
    layer_model_config(
      "fff", d_model=d_model, depth=depth, n_trees=n_trees, variant=variant, implementation="masked_dense"
    )
  )
  return sparse, dense


@pytest.mark.parametrize("variant", ["fff", "fff_post"])
@pytest.mark.parametrize("n_trees", [1, 4])
@pytest.mark.parametrize("depth", [0, 1, 3, 6])
def test_sparse_equals_masked_dense(depth, n_trees, variant):
  sparse, dense = fff_pair(depth, n_trees, variant)
  x = jax.random.normal(jax.random.key(depth * 10 + n_trees), (3, 11, 16))
  params = init_params(sparse, x)
  params["b_out"] = jax.random.normal(jax.random.key(5), params["b_out"].shape) * 0.1
  assert params["w_in"].shape == (n_trees, n_nodes(depth), 16)

  def run(layer):
    def loss(p, x):
      y, state = layer.apply({"params": p}, x, mutable=["intermediates"])
      return jnp.sum(jnp.sin(y)), (y, state["intermediates"]["path_nodes"][0])

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)

  (g_sparse, (y_sparse, path_sparse)), (g_dense, (y_dense, path_dense)) = run(sparse), run(dense)
  np.testing.assert_array_equal(path_sparse, path_dense)
  np.testing.assert_allclose(y_sparse, y_dense, rtol=1e-5, atol=1e-6)
  for (path, a), b in zip(jax.tree.leaves_with_path(g_sparse), jax.tree.leaves(g_dense)):
    # Sums of many terms that cancel: float32 rounding scales with the largest gradient.
    atol = 1e-6 * max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=jax.tree_util.keystr(path))
  # Only nodes on some token's path receive gradient; the rest stay exactly zero.
  visited = np.zeros((n_trees, n_nodes(depth)), bool)
  for p in range(n_trees):
    visited[p, np.unique(np.asarray(path_sparse)[:, :, p])] = True
  assert np.all(np.asarray(g_sparse[0]["w_in"])[~visited] == 0)


def test_path_is_heap_ordered_and_zero_routes_left():
  assert int(next_node(jnp.int32(0), jnp.float32(0.0))) == 1
  assert int(next_node(jnp.int32(0), jnp.float32(1e-30))) == 2
  assert int(next_node(jnp.int32(2), jnp.float32(-1.0))) == 5
  depth = 3
  for implementation in ("sparse", "masked_dense"):
    layer = Fff(layer_model_config("fff", depth=depth, n_trees=2, implementation=implementation))
    x = jnp.zeros((1, 2, 32))
    params = init_params(layer, x)
    params["b_in"] = jnp.zeros_like(params["b_in"])  # every logit is exactly 0
    _, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    path = np.asarray(state["intermediates"]["path_nodes"][0])
    np.testing.assert_array_equal(path[0, 0, 0], [0, 1, 3, 7])  # always the left child 2s + 1


def test_path_follows_the_sign_of_each_logit():
  layer = Fff(layer_model_config("fff", depth=4, n_trees=3))
  x = jax.random.normal(jax.random.key(0), (2, 6, 32))
  params = init_params(layer, x)
  _, state = layer.apply({"params": params}, x, mutable=["intermediates"])
  path = np.asarray(state["intermediates"]["path_nodes"][0])
  logits = np.asarray(state["intermediates"]["node_logits"][0])
  w_in, b_in = np.asarray(params["w_in"]), np.asarray(params["b_in"])
  for b, t, p in np.ndindex(2, 6, 3):
    node = 0
    for level in range(5):
      assert path[b, t, p, level] == node
      z = float(np.dot(np.asarray(x[b, t]), w_in[p, node]) + b_in[p, node])
      np.testing.assert_allclose(logits[b, t, p, level], z, rtol=1e-5, atol=1e-5)
      node = 2 * node + (2 if z > 0 else 1)


def test_initialization_follows_ultrafastbert():
  depth, n_trees, d_model = 5, 8, 64
  layer = Fff(layer_model_config("fff", d_model=d_model, depth=depth, n_trees=n_trees))
  params = init_params(layer, jnp.zeros((1, 1, d_model)))
  for name, limit in [("w_in", d_model**-0.5), ("b_in", d_model**-0.5), ("w_out", ((depth + 1) * n_trees) ** -0.5)]:
    values = np.asarray(params[name])
    assert np.abs(values).max() <= limit and np.abs(values).max() > 0.95 * limit, name
    np.testing.assert_allclose(values.std(), limit / np.sqrt(3), rtol=0.1, err_msg=name)
  assert np.all(np.asarray(params["b_out"]) == 0)


def test_dense_top_levels_equal_a_walk_that_gathers_every_level():
  """The top levels come from one matmul; gathering every level instead gives the same paths and outputs."""
  from sparsetx.kernels.fff.tree_route import sparse_forward
  from sparsetx.kernels.rows.gated_gather import KernelOptions

  depth, n_trees, d_model = 4, 3, 16
  k = jax.random.split(jax.random.key(7), 4)
  x = jax.random.normal(k[0], (21, d_model))
  w_in, w_out = (jax.random.normal(key, (n_trees, n_nodes(depth), d_model)) / 4 for key in k[1:3])
  b_in = jax.random.normal(k[3], (n_trees, n_nodes(depth))) * 0.1
  options = KernelOptions("xla", 4, 16)
  runs = [
    sparse_forward(x, w_in, b_in, w_out, depth, jax.nn.gelu, options, dense_levels=levels) for levels in (0, 2, 5)
  ]
  for y, path, z in runs[1:]:
    np.testing.assert_array_equal(path, runs[0][1])
    np.testing.assert_allclose(z, runs[0][2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, runs[0][0], rtol=1e-5, atol=1e-6)
