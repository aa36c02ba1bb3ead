"""The papers' formulation of the gated gather (sgatlin Listing 1), kept as the reference.

y = sum_s gate_s * w_out[row_s] * act(<w_in[row_s], x> + bias[row_s]). It gathers the selected rows
into two [B, T, S, D] tensors and contracts them, which is what makes it slow (memory traffic);
the fast paths in this package are tested and benchmarked against it. Dots and the gated sum
accumulate in float32; the output has x's dtype.
"""

import jax
import jax.numpy as jnp


def identity(h):
  return h


def derivative(activation, h):
  """act'(h) for an elementwise activation (a JVP with unit tangent): the backward kernels' dL/dh factor."""
  return jax.jvp(activation, (h,), (jnp.ones_like(h),))[1]


def gated_gather_reference(x_BTD, w_in_RD, w_out_RD, rows_BTS, gates_BTS, activation=identity, bias_R=None):
  compute_dtype = x_BTD.dtype
  w_in_BTSD = w_in_RD[rows_BTS].astype(compute_dtype)
  w_out_BTSD = w_out_RD[rows_BTS].astype(compute_dtype)
  h_BTS = jnp.einsum("btd,btsd->bts", x_BTD, w_in_BTSD, preferred_element_type=jnp.float32)
  if bias_R is not None:
    h_BTS = h_BTS + bias_R[rows_BTS].astype(jnp.float32)
  h_BTS = activation(h_BTS) * gates_BTS.astype(jnp.float32)
  y_BTD = jnp.einsum("bts,btsd->btd", h_BTS.astype(compute_dtype), w_out_BTSD, preferred_element_type=jnp.float32)
  return y_BTD.astype(compute_dtype)
