"""One device's d-slice of the gated gather, for a neuron table whose d_model is split over mesh axes.

Runs inside a `jax.shard_map` (sparsetx/parallel/dispatch.py sets it up): each device holds the columns
`d-slice` of both tables and of its tokens' x, and the dots <w_in[row], x> are partial. Summed over the
split axes (`axes`, a psum of [tokens, slots] float32 scalars) they are whole before the activation and
the gate act on them, which is why the split is exact; the gated w_out rows then give this device's
d-slice of y. The dots and sums are the XLA gather's (xla_gather.py: token-chunked row gathers, float32
accumulation) and the table gradients its sorted-segment sums (segment_grads.py); the Pallas kernels
have no partial-dot entry point. docs/expert_parallel.md has the collectives and their sizes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx.kernels import segment_grads, xla_gather


def rows_dot(options, a_hd, table_Rd, rows_hS):
  """[h, S]: <a[t], table[rows[t, s]]> in float32, `token_chunk` tokens' rows gathered at a time."""

  def step(_, chunk):
    a_cd, rows_cS = chunk
    return None, xla_gather.pre_activation(a_cd, table_Rd, rows_cS, None)[0]

  _, dots = jax.lax.scan(step, None, xla_gather.chunked([a_hd, rows_hS], options.token_chunk))
  return xla_gather.unchunk(dots, a_hd.shape[0])


def rows_sum(options, coef_hS, table_Rd, rows_hS, dtype):
  """[h, d]: sum_s coef[t, s] * table[rows[t, s]] in float32 (factors in `dtype`), chunked like `rows_dot`."""

  def step(_, chunk):
    coef_cS, rows_cS = chunk
    return None, xla_gather.weighted_rows(coef_cS, table_Rd, rows_cS, dtype)

  _, sums = jax.lax.scan(step, None, xla_gather.chunked([coef_hS, rows_hS], options.token_chunk))
  return xla_gather.unchunk(sums, coef_hS.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def sliced_gated_gather(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  """y [h, d] float32: this device's d-slice of the gated gather, the partial dots summed over mesh `axes`.

  `gating` is a reference.Gating, `options` a KernelOptions (token chunk of the gathers, pair chunk of the
  table gradients); x_hd, w_in_Rd, w_out_Rd are d-slices, rows_hS and gates_hS whole.
  """
  return _forward(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS)[0]


def _forward(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  partial_hS = rows_dot(options, x_hd, w_in_Rd, rows_hS)
  h_hS = jax.lax.psum(partial_hS, axes) if axes else partial_hS
  a_hS = gating.value(h_hS, gates_hS.astype(jnp.float32))
  y_hd = rows_sum(options, a_hS, w_out_Rd, rows_hS, x_hd.dtype)
  return y_hd, (x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS)


def _backward(gating, options, axes, residuals, dy_hd):
  """Gradients as the gated gather's (sorted-segment table sums), with the d-group's sums made explicit.

  <dy, w_out[row]> is partial on a d-slice: summed over the d-group it drives dL/dh (the same on
  every device of the group, as h is); left partial it gives this slice's share of the gate
  gradient (da/dgate * partial dyw: linear in dyw), which the transpose of the gates' all-gather sums
  over the group.
  """
  x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS = residuals
  dy_hd = dy_hd.astype(x_hd.dtype)
  dyw_partial_hS = rows_dot(options, dy_hd, w_out_Rd, rows_hS)
  dyw_hS = jax.lax.psum(dyw_partial_hS, axes) if axes else dyw_partial_hS
  a_hS, da_dh_hS, da_dg_hS = gating.value_and_slopes(h_hS, gates_hS.astype(jnp.float32))
  coef_in_hS = da_dh_hS * dyw_hS
  dx_hd = rows_sum(options, coef_in_hS, w_in_Rd, rows_hS, x_hd.dtype)
  dw_in, dw_out, _ = segment_grads.table_grads(
    x_hd, dy_hd, rows_hS, coef_in_hS, a_hS, w_in_Rd.shape[0], options.pair_chunk, False
  )
  return (
    dx_hd.astype(x_hd.dtype),
    dw_in.astype(w_in_Rd.dtype),
    dw_out.astype(w_out_Rd.dtype),
    np.zeros(rows_hS.shape, jax.dtypes.float0),
    (da_dg_hS * dyw_partial_hS).astype(gates_hS.dtype),
  )


sliced_gated_gather.defvjp(_forward, _backward)
