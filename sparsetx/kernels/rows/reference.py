"""The papers' formulation of the gated gather (sgatlin Listing 1), and where the gate meets the activation.

y = sum_s a(h_s, g_s) * w_out[row_s], h_s = <w_in[row_s], x> + bias[row_s], with the slot coefficient a
set by `Gating`: gate inside the activation, a = act(g * h) (sgatlin's official code: `z = z * scores`
then the activation; the default), or outside, a = g * act(h) (PEER's official code: softmax scores times
GELU'd neurons; FFF, whose gates are 1). With the identity both are g * h, bit for bit.
`gated_gather_reference` gathers the selected rows into two [B, T, S, D] tensors and contracts them,
which is what makes it slow (memory traffic); the benchmarks time the fast paths against it. Dots and
the gated sum accumulate in float32; the output has x's dtype.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


def identity(h):
  return h


def gelu(x):
  """Exact (erf) GELU, as in GPT-NeoX, the FFF paper and UltraFastBERT (torch's default nn.GELU)."""
  return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x):
  """GELU's tanh approximation: `jax.nn.gelu`'s default, as the PEER and sgatlin authors' code calls it."""
  return jax.nn.gelu(x, approximate=True)


# The activations a layer hands the kernels, by the name a kernel call is described with (op_calls.py).
ACTIVATIONS = {"identity": identity, "relu": jax.nn.relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "swish": jax.nn.silu}


def derivative(activation, h):
  """act'(h) for an elementwise activation (a JVP with unit tangent): the backward kernels' dL/dh factor."""
  return jax.jvp(activation, (h,), (jnp.ones_like(h),))[1]


class Gating(NamedTuple):
  """A slot's output coefficient a from its pre-activation h and gate g, and a's slopes (static, hashable).

  gate_inside: a = act(g h), da/dh = g act'(g h), da/dg = h act'(g h) (sgatlin, official);
  otherwise    a = g act(h), da/dh = g act'(h),   da/dg = act(h)       (PEER, FFF).
  With dyw = <dy, w_out[row]>: dL/dh = da/dh * dyw (w_in's and x's coefficient), dL/dg = da/dg * dyw,
  and a multiplies dy into w_out's row; act' is a JVP of act.
  """

  activation: Callable = identity
  gate_inside: bool = True

  @property
  def linear_in_gate(self) -> bool:
    """a(h, g1) + a(h, g2) == a(h, g1 + g2): two slots of one token on one row may be merged."""
    return not self.gate_inside or self.activation is identity

  def _slope(self, u):
    return derivative(self.activation, u)

  def value(self, h, g):
    """a, float32 (h, g are float32)."""
    return self.activation(g * h) if self.gate_inside else g * self.activation(h)

  def value_and_slopes(self, h, g):
    """(a, da/dh, da/dg), float32."""
    if self.gate_inside:
      u = g * h
      d = self._slope(u)
      return self.activation(u), g * d, h * d
    act = self.activation(h)
    return g * act, g * self._slope(h), act


def gated_gather_reference(
  x_BTD, w_in_RD, w_out_RD, rows_BTS, gates_BTS, activation=identity, bias_R=None, gate_inside_activation=True
):
  compute_dtype = x_BTD.dtype
  w_in_BTSD = w_in_RD[rows_BTS].astype(compute_dtype)
  w_out_BTSD = w_out_RD[rows_BTS].astype(compute_dtype)
  h_BTS = jnp.einsum("btd,btsd->bts", x_BTD, w_in_BTSD, preferred_element_type=jnp.float32)
  if bias_R is not None:
    h_BTS = h_BTS + bias_R[rows_BTS].astype(jnp.float32)
  h_BTS = Gating(activation, gate_inside_activation).value(h_BTS, gates_BTS.astype(jnp.float32))
  y_BTD = jnp.einsum("bts,btsd->btd", h_BTS.astype(compute_dtype), w_out_BTSD, preferred_element_type=jnp.float32)
  return y_BTD.astype(compute_dtype)
