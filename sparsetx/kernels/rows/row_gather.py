"""The gated gather on a GPU or TPU, composed from one implementation's two row kernels (kernels/rows/interface.py):
row_dots gives the forward's x . w_in, the backward's dy . w_out and FFF's per-level logits; row_accumulate the
forward's y from w_out and the backward's dx from w_in.

More: docs/modules.md, sparsetx/kernels/rows/row_gather.py.
"""

import jax.numpy as jnp


def stream_dtype(x_dtype, table_dtype):
  """The dtype a table's rows are read in: x's when it is the narrower float (a bf16 run), else the table's."""
  x_dtype, table_dtype = jnp.dtype(x_dtype), jnp.dtype(table_dtype)
  return x_dtype if x_dtype.itemsize < table_dtype.itemsize else table_dtype


def dots(backend, lhs_ND, table_RD, rows_NS, options):
  """[N, S] float32: <lhs[t], table[rows[t, s]]>, the table's rows rounded to lhs's dtype."""
  return backend.row_dots(lhs_ND, table_RD, rows_NS.T, options).T


def accumulate(backend, coef_NS, table_RD, rows_NS, out_dtype, options):
  """[N, D] out_dtype: sum_s coef[t, s] * table[rows[t, s]], float32 sums."""
  return backend.row_accumulate(coef_NS.astype(jnp.float32).T, table_RD, rows_NS.T, out_dtype, options)


def forward(backend, x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  """y [N, D] (x's dtype) and the pre-activations h [N, S] (float32, kept for the backward)."""
  h_NS = dots(backend, x_ND, w_in_RD, rows_NS, options)
  if bias_R is not None:
    h_NS = h_NS + bias_R[rows_NS].astype(jnp.float32)
  return forward_from_pre_activation(backend, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options), h_NS


def forward_from_pre_activation(backend, x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
  """y [N, D] from given pre-activations h [N, S]: only w_out rows are gathered (FFF's walk has the logits)."""
  a_NS = gating.value(h_NS, gates_NS.astype(jnp.float32)).astype(x_ND.dtype)
  return accumulate(backend, a_NS, w_out_RD, rows_NS, x_ND.dtype, options)


def backward_rows(backend, dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
  """dx [N, D], dgates, coef_in = dL/dh and coef_out = a(h, gate) ([N, S] float32), as xla_gather.backward_rows."""
  dyw_NS = dots(backend, dy_ND, w_out_RD, rows_NS, options)
  a_NS, da_dh_NS, da_dg_NS = gating.value_and_slopes(h_NS, gates_NS.astype(jnp.float32))
  coef_in_NS = da_dh_NS * dyw_NS
  dx_ND = accumulate(backend, coef_in_NS.astype(dy_ND.dtype), w_in_RD, rows_NS, dy_ND.dtype, options)
  return dx_ND, da_dg_NS * dyw_NS, coef_in_NS, a_NS
