"""XLA's row kernels (the interface's three, and the row-order dots), as a module like the Pallas ones, so XLA is
one implementation among the others in rows/table.py; and XLA's own fused forms of the gated gather (the interface's
optional hooks: token-chunked scans of the gather, dots, gating and sums; the tables' sorted scatter-adds; FFF's
gathered walk). On a CPU each walks cache-sized chunks; elsewhere one chunk holds every token or pair
(kernels/platform.py).

More: docs/modules.md, sparsetx/kernels/rows/xla.py.
"""

import jax
import jax.numpy as jnp

from sparsetx.kernels import platform
from sparsetx.kernels.fff import tree_walk
from sparsetx.kernels.rows import segment_grads, xla_gather


def row_dots(lhs_ND, table_RD, rows_SN, options):
  """dots [S, N] float32: <lhs[t], table[rows[s, t]]>, the table's rows rounded to lhs's dtype."""
  return xla_gather.chunked_dots(lhs_ND, table_RD, rows_SN.T, options).T


def row_accumulate(coef_SN, table_RD, rows_SN, out_dtype, options):
  """out [N, D] in out_dtype: sum_s coef[s, t] * table[rows[s, t]], float32 sums."""
  return xla_gather.chunked_sums(coef_SN.T, table_RD, rows_SN.T, jnp.float32, options).astype(out_dtype)


def segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums=False):
  return segment_grads.scatter_segment_sums(values_ND, tokens_P, coefs_P, starts_R1, options, with_coef_sums)


def row_order_dots(lhs_ND, table_RD, tokens_P, rows_P, starts_R1, options):
  """dots [P] float32 of pairs sorted by row: dots[p] = <lhs[tokens[p]], table[rows[p]]>, the table's rows rounded
  to lhs's dtype. One gather-dot fusion over the pairs in row order: consecutive pairs read the same table row, so
  a row comes from HBM about once and its repeats from cache, while the tokens' rows (a batch's are few MB) stay in
  L2. On a CPU, `pair_chunk` pairs per step."""
  del starts_R1  # the rows themselves are at hand
  n_pairs = tokens_P.shape[0]

  def step(_, chunk):
    tokens_c, rows_c = chunk
    table_cD = table_RD[rows_c].astype(lhs_ND.dtype)
    return None, jnp.einsum("cd,cd->c", lhs_ND[tokens_c], table_cD, preferred_element_type=jnp.float32)

  chunks = xla_gather.chunked([tokens_P, rows_P], platform.cpu_chunk(options.pair_chunk, n_pairs))
  _, dots = jax.lax.scan(step, None, chunks)
  return xla_gather.unchunk(dots, n_pairs)


def fused_forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options):
  """y [N, D] and h [N, S]: the gather, dots, gating and sum fused by XLA, token chunk by chunk (xla_gather.py)."""
  return xla_gather.forward(x_ND, w_in_RD, w_out_RD, rows_NS, gates_NS, bias_R, gating, options)


def forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options):
  return xla_gather.forward_from_pre_activation(x_ND, w_out_RD, rows_NS, gates_NS, h_NS, gating, options)


def backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options):
  return xla_gather.backward_rows(dy_ND, h_NS, w_in_RD, w_out_RD, rows_NS, gates_NS, gating, options)


def table_sums(x_ND, dy_ND, pairs, n_rows, options, with_bias):
  """The tables' sums as sorted scatter-adds, pair chunk by chunk (segment_grads.scan_table_sums)."""
  return segment_grads.scan_table_sums(x_ND, dy_ND, pairs, n_rows, options, with_bias)


def walk(x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
  """FFF's walk gathering one w_in row per (token, tree) per level, token chunk by chunk (tree_walk.gathered)."""
  return tree_walk.gathered(x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk)
