import jax
import numpy as np
import pytest

from sparsetx.config import ConfigError, n_keys_for
from sparsetx.kernels import platform
from sparsetx.kernels.device import TracedDevice
from sparsetx.models.ffn.product_keys import product_key_top_k


@pytest.mark.parametrize("batch, n_keys, k", [((7,), 8, 1), ((3, 5), 16, 8), ((2, 3, 4), 32, 15), ((64,), 112, 8)])
def test_equals_brute_force_top_k(batch, n_keys, k):
  k1, k2 = jax.random.split(jax.random.key(n_keys + k))
  s1 = jax.random.normal(k1, batch + (n_keys,))
  s2 = jax.random.normal(k2, batch + (n_keys,))
  values, indices = product_key_top_k(s1, s2, k)
  all_sums = (s1[..., :, None] + s2[..., None, :]).reshape(batch + (n_keys * n_keys,))
  want_values, want_indices = jax.lax.top_k(all_sums, k)
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(values, want_values)  # the same float32 sums, so bit-equal


def test_gradient_reaches_both_halves():
  s1 = jax.random.normal(jax.random.key(0), (16,))
  s2 = jax.random.normal(jax.random.key(1), (16,))
  g1, g2 = jax.grad(lambda a, b: product_key_top_k(a, b, 4)[0].sum(), argnums=(0, 1))(s1, s2)
  _, idx = product_key_top_k(s1, s2, 4)
  np.testing.assert_array_equal(g1, np.bincount(np.asarray(idx) // 16, minlength=16))
  np.testing.assert_array_equal(g2, np.bincount(np.asarray(idx) % 16, minlength=16))


def test_refuses_top_k_not_below_n_keys():
  s = jax.numpy.zeros((4, 8))
  with pytest.raises(ConfigError, match="top_k=8"):
    product_key_top_k(s, s, 8)


@pytest.mark.parametrize("d_ffw", [1000, 0, 63])
def test_refuses_non_square_d_ffw(d_ffw):
  with pytest.raises(ConfigError, match=f"d_ffw={d_ffw} must be a perfect square"):
    n_keys_for(d_ffw)


def brute_force_top_k(s1, s2, k):
  all_sums = (s1[..., :, None] + s2[..., None, :]).reshape(s1.shape[:-1] + (-1,))
  return jax.lax.top_k(all_sums, k)


def lax_top_k_product_keys(s1, s2, k):
  """The formulation product_key_top_k had before its CPU passes: lax.top_k on each half, then on all k*k sums."""
  n_keys = s1.shape[-1]
  v1, i1 = jax.lax.top_k(s1, k)
  v2, i2 = jax.lax.top_k(s2, k)
  flat_shape = v1.shape[:-1] + (k * k,)
  values, best = jax.lax.top_k((v1[..., :, None] + v2[..., None, :]).reshape(flat_shape), k)
  return values, jax.numpy.take_along_axis((i1[..., :, None] * n_keys + i2[..., None, :]).reshape(flat_shape), best, -1)


def tied_scores(key, shape):
  """Small integers: many exactly equal sums, none equal only by rounding (as +0.0 and -0.0 would be)."""
  return jax.random.randint(key, shape, -2, 3).astype(np.float32)


def traced_afresh(top_k, k: int):
  """`top_k` jitted through a new function: jit's trace cache, keyed by the function, would hand the second backend
  of a test the first one's program (the platform switch is read while tracing)."""
  return jax.jit(lambda s1, s2: top_k(s1, s2, k))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("batch, n_keys, k", [((300,), 8, 1), ((2, 150), 12, 5), ((3, 7), 40, 8)])
def test_ties_go_to_the_lower_neuron_index_like_brute_force(monkeypatch, backend, batch, n_keys, k):
  """Exact ties; rows span several CPU chunks; both the CPU passes and the accelerators' lax.top_k stage one."""
  k1, k2 = jax.random.split(jax.random.key(n_keys * k))
  s1, s2 = tied_scores(k1, batch + (n_keys,)), tied_scores(k2, batch + (n_keys,))
  # The accelerators' XLA form, run here: the target the layer reads (kernels/platform.target) says gpu.
  monkeypatch.setattr(platform, "target", lambda: TracedDevice(backend, backend, None))
  values, indices = traced_afresh(product_key_top_k, k)(s1, s2)
  want_values, want_indices = brute_force_top_k(s1, s2, k)
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(values, want_values)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_tied_case_where_lax_top_k_of_the_k_by_k_sums_picks_a_higher_index(monkeypatch, backend):
  """s1 = [1, 2, 0], s2 = [3, 2, 0], k = 2: sums 4 at neuron 0 (1+3) and neuron 4 (2+2); brute force takes 0.
  Both the CPU passes and the accelerators' sort of the candidate pairs (whose neuron key breaks the tie: a
  sort by the sums alone keeps the candidates' order and picks 4)."""
  s1, s2 = np.float32([1, 2, 0]), np.float32([3, 2, 0])
  assert lax_top_k_product_keys(s1, s2, 2)[1].tolist() == [3, 4]
  monkeypatch.setattr(platform, "target", lambda: TracedDevice(backend, backend, None))
  got = traced_afresh(product_key_top_k, 2)(s1, s2)[1].tolist()
  assert got == [3, 0] == brute_force_top_k(s1, s2, 2)[1].tolist()


def test_values_indices_and_gradients_equal_the_lax_top_k_formulation():
  n_keys = 40  # ladder scale 2
  k1, k2, k3 = jax.random.split(jax.random.key(n_keys), 3)
  s1, s2 = jax.random.normal(k1, (32, 16, n_keys)), jax.random.normal(k2, (32, 16, n_keys))
  weights = jax.random.randint(k3, (32, 16, 8), -8, 9).astype(np.float32)  # integer: gradient sums are exact

  def grads(top_k):
    return jax.jit(jax.grad(lambda a, b: (top_k(a, b, 8)[0] * weights).sum(), argnums=(0, 1)))(s1, s2)

  for got, want in zip(product_key_top_k(s1, s2, 8), lax_top_k_product_keys(s1, s2, 8)):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(grads(product_key_top_k), grads(lax_top_k_product_keys)):
    np.testing.assert_array_equal(got, want)
