"""Activations inside Pallas kernels: erf and erfc from float32 arithmetic that every Pallas backend lowers.

Neither Pallas TPU (Mosaic) nor the Pallas Triton lowering implements `erfc` (exact GELU, `jax.nn.gelu(x,
approximate=False)`, is `0.5 x erfc(-x / sqrt 2)`), and Triton has no `erf` either. `lowerable(fn)` traces
an elementwise function and evaluates it again with each erf/erfc replaced by `erf` below: the float32
rational approximation XLA and Eigen use for erf (odd degree-13 numerator over even degree-8 denominator on
[-4, 4], where float32 erf reaches +-1), built from clamps, multiplies, adds and one divide. Only kernels
use it; XLA code keeps the library's erf.

Its values are within a few float32 ulp of `jax.scipy.special.erf`; GELU computed from it,
`x * (1 + erf(x / sqrt 2)) / 2`, therefore has an absolute error of a few eps * |x| (the cancellation in
`1 + erf` for very negative x is at the float32 rounding of Phi(x), an absolute quantity), and its
derivative, taken by `jax.jvp` before the substitution (`lowerable(derivative)`), keeps the exact
exp(-x^2) term. tests/test_kernel_math.py checks both.
"""

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

# erf(x) ~ x * P(x^2) / Q(x^2) for |x| <= 4, coefficients highest degree first (XLA's ErfImpl32 / Eigen's
# generic_fast_erf_float).
_ERF_P = (
  -2.72614225801306e-10,
  2.77068142495902e-08,
  -2.10102402082508e-06,
  -5.69250639462346e-05,
  -7.34990630326855e-04,
  -2.95459980854025e-03,
  -1.60960333262415e-02,
)
_ERF_Q = (
  -1.45660718464996e-05,
  -2.13374055278905e-04,
  -1.68282697438203e-03,
  -7.37332916720468e-03,
  -1.42647390514189e-02,
)


def _horner(coefficients, z):
  acc = jnp.full_like(z, coefficients[0])
  for c in coefficients[1:]:
    acc = acc * z + jnp.float32(c)
  return acc


def erf(x):
  """erf in float32 arithmetic (returned in x's dtype), clamped to [-1, 1]."""
  x32 = jnp.clip(x.astype(jnp.float32), -4.0, 4.0)
  z = x32 * x32
  return jnp.clip(x32 * _horner(_ERF_P, z) / _horner(_ERF_Q, z), -1.0, 1.0).astype(x.dtype)


def erfc(x):
  return (1.0 - erf(x).astype(jnp.float32)).astype(x.dtype)


# copy (jax.nn.gelu's closing jnp.array) is the identity on a value; Pallas TPU has no rule for it either.
_REPLACEMENTS = {
  jax_core.primitives.erf_p: erf,
  jax_core.primitives.erfc_p: erfc,
  jax_core.primitives.copy_p: lambda x: x,
}
# Calls whose body is evaluated in place, so an erf inside them (jax.nn.gelu is jitted) is found too. A
# custom_jvp call loses its rule here, so derivatives are taken before `lowerable` (see the module docstring).
_INLINED = {
  jax_core.primitives.jit_p: "jaxpr",
  jax_core.primitives.closed_call_p: "call_jaxpr",
  jax_core.primitives.custom_jvp_call_p: "call_jaxpr",
}


def _evaluate(jaxpr, consts, *args):
  env = {}

  def read(v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive in _REPLACEMENTS:
      outvals = [_REPLACEMENTS[eqn.primitive](*invals)]
    elif eqn.primitive in _INLINED:
      closed = eqn.params[_INLINED[eqn.primitive]]
      outvals = _evaluate(closed.jaxpr, closed.consts, *invals)
    else:
      outvals = eqn.primitive.bind(*invals, **eqn.params)
      outvals = outvals if eqn.primitive.multiple_results else [outvals]
    env.update(zip(eqn.outvars, outvals))
  return [read(v) for v in jaxpr.outvars]


def lowerable(fn):
  """fn (one array in, one out) with erf and erfc computed by `erf` above: what a Pallas kernel can lower."""

  def wrapped(x):
    closed = jax.make_jaxpr(fn)(x)
    (y,) = _evaluate(closed.jaxpr, closed.consts, x)
    return y

  return wrapped
