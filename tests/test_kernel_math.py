"""kernel_math: the kernels' erf equals the exact function, and exact GELU built on it keeps float32 accuracy.

References are float64 (scipy.special), rounded to float32 for ulp counts. Tolerances: the rational
approximation is good to ~2 ulp and its float32 evaluation (a clamp, 11 Horner multiply-adds, a divide, a
product by x) adds a few roundings of intermediates no larger than the result, so 8 ulp of erf(x).
GELU = x * Phi(x) with Phi = (1 + erf(x / sqrt 2)) / 2 <= 1: Phi inherits erf's error as an absolute error of
<= 8 ulp(1) / 2 = 4 eps, times |x|, plus the final products' rounding (<= 2 eps relative): |dGELU| <=
eps * (4 |x| + 2 |GELU|). Its derivative Phi(x) + x phi(x) is taken before the substitution, so only Phi
carries the approximation: 4 eps absolute.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jax.experimental import pallas as pl

from sparsetx.kernels import kernel_math
from sparsetx.kernels.reference import derivative
from sparsetx.models.ffn.common import ACTIVATIONS

EPS = float(np.finfo(np.float32).eps)
# every sign and scale: a dense sweep of [-10, 10] (erf saturates in float32 beyond |x| = 3.9), tiny values, zero
X = np.concatenate(
  [np.linspace(-10, 10, 200_001), np.geomspace(1e-30, 1e-2, 500), -np.geomspace(1e-30, 1e-2, 500), [0.0]]
).astype(np.float32)
X64 = X.astype(np.float64)


def exact_gelu(x):
  return 0.5 * x * scipy.special.erfc(-x / np.sqrt(2))


def test_erf_is_within_8_ulp_of_the_exact_function():
  got = np.asarray(kernel_math.erf(jnp.asarray(X)), np.float64)
  exact = scipy.special.erf(X64)
  ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
  assert np.all(np.abs(got - exact) <= 8 * ulp), np.max(np.abs(got - exact) / ulp)
  erfc = np.asarray(kernel_math.erfc(jnp.asarray(X)), np.float64)
  np.testing.assert_allclose(erfc, 1 - got, rtol=0, atol=EPS)  # 1 - erf, rounded once
  # and it is the library's erf where the library is float32 too
  np.testing.assert_allclose(got, jax.scipy.special.erf(jnp.asarray(X)), rtol=0, atol=8 * EPS)


def test_exact_gelu_from_the_kernel_erf_keeps_float32_accuracy():
  gelu = kernel_math.lowerable(ACTIVATIONS["gelu"])
  got = np.asarray(gelu(jnp.asarray(X)), np.float64)
  exact = exact_gelu(X64)
  assert np.all(np.abs(got - exact) <= EPS * (4 * np.abs(X64) + 2 * np.abs(exact)))
  slope = np.asarray(kernel_math.lowerable(lambda h: derivative(ACTIVATIONS["gelu"], h))(jnp.asarray(X)), np.float64)
  exact_slope = 0.5 * scipy.special.erfc(-X64 / np.sqrt(2)) + X64 * np.exp(-(X64**2) / 2) / np.sqrt(2 * np.pi)
  np.testing.assert_allclose(slope, exact_slope, rtol=0, atol=4 * EPS)


def test_lowerable_removes_every_erf_and_changes_nothing_else():
  x = jnp.asarray(X[::1000])
  activations = dict(ACTIVATIONS, gelu_tanh=lambda h: jax.nn.gelu(h, approximate=True))
  for name, act in activations.items():
    for fn in (act, functools.partial(derivative, act)):
      lowered = kernel_math.lowerable(fn)
      assert not re.search(r"\b(erf|erfc|copy)\b", str(jax.make_jaxpr(lowered)(x))), name
      if name != "gelu":
        np.testing.assert_array_equal(jax.jit(lowered)(x), jax.jit(fn)(x), err_msg=name)  # same ops, same program


def test_lowerable_gelu_runs_inside_a_pallas_kernel():
  def kernel(x_ref, y_ref):
    y_ref[...] = kernel_math.lowerable(ACTIVATIONS["gelu"])(x_ref[...])

  x = jnp.linspace(-6, 6, 8 * 128, dtype=jnp.float32).reshape(8, 128)
  y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
  exact = exact_gelu(np.asarray(x, np.float64))
  assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= EPS * (4 * np.abs(np.asarray(x)) + 2 * np.abs(exact)))
