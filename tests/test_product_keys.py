import jax
import numpy as np
import pytest

from sparsetx.config import ConfigError, n_keys_for
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
