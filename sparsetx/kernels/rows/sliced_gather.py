"""One device's d-slice of the gated gather, for a neuron table whose d_model is split over mesh axes: the
forward and backward the gated gather's custom VJP runs with `sum_axes`.

More: docs/modules.md, sparsetx/kernels/rows/sliced_gather.py.
"""

import jax
import jax.numpy as jnp

from sparsetx.kernels.rows import row_gather, segment_grads


def rows_dot(implementation, options, a_hd, table_Rd, rows_hS):
  """[h, S]: <a[t], table[rows[t, s]]> in float32 (rows rounded to a's dtype)."""
  return row_gather.dots(implementation, a_hd, table_Rd, rows_hS, options)


def rows_sum(implementation, options, coef_hS, table_Rd, rows_hS, dtype):
  """[h, d] float32: sum_s coef[t, s] * table[rows[t, s]], both factors rounded to `dtype`, float32 sums
  (kept float32: the unit-split sums these partial outputs over devices before rounding). The table already streams
  in the compute dtype (forward): its rows are `dtype` values."""
  return row_gather.accumulate(implementation, coef_hS.astype(dtype), table_Rd, rows_hS, jnp.float32, options)


def forward(implementation, gating, options, axes, stream, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  """(y [h, d] float32, residuals): this device's d-slice of the gated gather, the partial dots summed over mesh
  `axes` before the activation and the gate. x and the tables are d-slices, rows and gates whole; the tables
  stream in `stream` (one cast, kept as residuals)."""
  w_in_Rd, w_out_Rd = w_in_Rd.astype(stream), w_out_Rd.astype(stream)
  h_hS = jax.lax.psum(rows_dot(implementation, options, x_hd, w_in_Rd, rows_hS), axes)
  a_hS = gating.value(h_hS, gates_hS.astype(jnp.float32))
  y_hd = rows_sum(implementation, options, a_hS, w_out_Rd, rows_hS, x_hd.dtype)
  return y_hd, (x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS)


def backward(implementation, gating, options, axes, residuals, dy_hd):
  """(dx, dw_in, dw_out, dgates) as the gated gather's (sorted-segment table sums), with the d-group's sums
  made explicit, all float32.

  <dy, w_out[row]> is partial on a d-slice: summed over the d-group it drives dL/dh (the same on
  every device of the group, as h is); left partial it gives this slice's share of the gate
  gradient (da/dgate * partial dyw: linear in dyw), which the transpose of the gates' all-gather sums
  over the group.
  """
  x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS = residuals
  dy_hd = dy_hd.astype(x_hd.dtype)
  dyw_partial_hS = rows_dot(implementation, options, dy_hd, w_out_Rd, rows_hS)
  dyw_hS = jax.lax.psum(dyw_partial_hS, axes)
  a_hS, da_dh_hS, da_dg_hS = gating.value_and_slopes(h_hS, gates_hS.astype(jnp.float32))
  coef_in_hS = da_dh_hS * dyw_hS
  dx_hd = rows_sum(implementation, options, coef_in_hS, w_in_Rd, rows_hS, x_hd.dtype)
  dw_in, dw_out, _ = segment_grads.table_grads(
    implementation, x_hd, dy_hd, rows_hS, coef_in_hS, a_hS, w_in_Rd.shape[0], options, False
  )
  return dx_hd, dw_in, dw_out, da_dg_hS * dyw_partial_hS
