"""The gated gather shared by sgatlin and PEER: y = sum_s gate_s * w_out[row_s] * act(<w_in[row_s], x>).

Tables are flat `[rows, D]` (sgatlin flattens its `(C, d_ffw)` channels into rows `c * d_ffw + i`;
PEER's table is shared by its channels, so rows are the neuron ids themselves).

This is the papers' own formulation: it gathers the selected rows into `[B, T, S, D]` tensors and
contracts them. Dots and the gated sum accumulate in float32.
"""

import jax
import jax.numpy as jnp


def gated_gather(x_BTD, w_in_RD, w_out_RD, rows_BTS, gates_BTS, activation=lambda h: h):
  compute_dtype = x_BTD.dtype
  w_in_BTSD = w_in_RD[rows_BTS].astype(compute_dtype)
  w_out_BTSD = w_out_RD[rows_BTS].astype(compute_dtype)
  h_BTS = jnp.einsum("btd,btsd->bts", x_BTD, w_in_BTSD, preferred_element_type=jnp.float32)
  h_BTS = activation(h_BTS) * gates_BTS.astype(jnp.float32)
  y_BTD = jnp.einsum("bts,btsd->btd", h_BTS.astype(compute_dtype), w_out_BTSD, preferred_element_type=jnp.float32)
  return y_BTD.astype(compute_dtype)
