"""One device's d-slice of the gated gather, for a neuron table whose d_model is split over mesh axes.

More: docs/modules.md, sparsetx/kernels/sliced_gather.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsetx.kernels import platform, row_gather, segment_grads, xla_gather
from sparsetx.kernels.gated_gather import TableDtypes, stream_dtype


def _scan_chunks(step, arrays, options):
  """[h, ...]: step(*chunk) over the tokens in `platform.cpu_chunk(options.token_chunk)` chunks."""
  n_tokens = arrays[0].shape[0]
  chunks = xla_gather.chunked(arrays, platform.cpu_chunk(options.token_chunk, n_tokens))
  _, out = jax.lax.scan(lambda _, chunk: (None, step(*chunk)), None, chunks)
  return xla_gather.unchunk(out, n_tokens)


def rows_dot(options, a_hd, table_Rd, rows_hS):
  """[h, S]: <a[t], table[rows[t, s]]> in float32 (rows rounded to a's dtype)."""
  backend = platform.kernel_backend(options)
  if backend is None:
    return _scan_chunks(
      lambda a_cd, rows_cS: xla_gather.pre_activation(a_cd, table_Rd, rows_cS, None)[0], [a_hd, rows_hS], options
    )
  return row_gather.dots(backend, a_hd, table_Rd, rows_hS, options)


def rows_sum(options, coef_hS, table_Rd, rows_hS, dtype):
  """[h, d] float32: sum_s coef[t, s] * table[rows[t, s]], both factors rounded to `dtype`, float32 sums
  (kept float32: the unit-split sums these partial outputs over devices before rounding)."""
  backend = platform.kernel_backend(options)
  if backend is None:
    step = lambda coef_cS, rows_cS: xla_gather.weighted_rows(coef_cS, table_Rd, rows_cS, dtype)  # noqa: E731
    return _scan_chunks(step, [coef_hS, rows_hS], options)

  # The table already streams in the compute dtype (_forward): its rows are `dtype` values, summed into float32.
  return row_gather.accumulate(backend, coef_hS.astype(dtype), table_Rd, rows_hS, jnp.float32, options)


def sliced_gated_gather(gating, options, axes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  """y [h, d] float32: this device's d-slice of the gated gather, the partial dots summed over mesh `axes`.

  `gating` is a reference.Gating, `options` a KernelOptions; x_hd, w_in_Rd, w_out_Rd are d-slices, rows_hS and
  gates_hS whole.
  """
  dtypes = TableDtypes(jnp.dtype(w_in_Rd.dtype), stream_dtype(x_hd.dtype, w_in_Rd.dtype))
  return _sliced(gating, options, axes, dtypes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _sliced(gating, options, axes, dtypes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  return _forward(gating, options, axes, dtypes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS)[0]


def _forward(gating, options, axes, dtypes, x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS):
  w_in_Rd, w_out_Rd = w_in_Rd.astype(dtypes.stream), w_out_Rd.astype(dtypes.stream)  # residuals: no second cast
  partial_hS = rows_dot(options, x_hd, w_in_Rd, rows_hS)
  h_hS = jax.lax.psum(partial_hS, axes) if axes else partial_hS
  a_hS = gating.value(h_hS, gates_hS.astype(jnp.float32))
  y_hd = rows_sum(options, a_hS, w_out_Rd, rows_hS, x_hd.dtype)
  return y_hd, (x_hd, w_in_Rd, w_out_Rd, rows_hS, gates_hS, h_hS)


def _backward(gating, options, axes, dtypes, residuals, dy_hd):
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
  dw_in, dw_out, _ = segment_grads.table_grads(x_hd, dy_hd, rows_hS, coef_in_hS, a_hS, w_in_Rd.shape[0], options, False)
  return (
    dx_hd.astype(x_hd.dtype),
    dw_in.astype(dtypes.param),
    dw_out.astype(dtypes.param),
    np.zeros(rows_hS.shape, jax.dtypes.float0),
    (da_dg_hS * dyw_partial_hS).astype(gates_hS.dtype),
  )


_sliced.defvjp(_forward, _backward)
