"""FFF's walk down its trees, level by level: each level's logit picks the next level's node (tree_route.py).

Two forms: one row_dots launch per level over every token (an implementation's kernels), and XLA's token-chunked
gather of one w_in row per (token, tree) per level, a chunk's rows small enough to stay in a CPU's cache.
"""

import jax
import jax.numpy as jnp

from sparsetx.kernels import platform
from sparsetx.kernels.rows import row_gather
from sparsetx.kernels.rows.xla_gather import chunked, unchunk


def next_node(node, z):
  """Heap-order child: right (2s + 2) when z > 0, else left (2s + 1); a logit of exactly 0 goes left."""
  return 2 * node + 1 + (z > 0).astype(node.dtype)


def with_row_dots(implementation, options, x_ND, w_in_PMD, b_in_PM, node_NP, n_levels):
  """Walks n_levels levels down from node_NP with one row_dots launch per level; nodes and logits [N, P, n_levels]."""
  P, M, D = w_in_PMD.shape
  w_in_RD = w_in_PMD.reshape(P * M, D).astype(row_gather.stream_dtype(x_ND.dtype, w_in_PMD.dtype))
  offset_P = M * jnp.arange(P, dtype=jnp.int32)
  tree_P = jnp.arange(P)

  nodes, logits = [], []
  for _level in range(n_levels):
    rows_NP = node_NP + offset_P[None, :]
    z_NP = row_gather.dots(implementation, x_ND, w_in_RD, rows_NP, options)
    z_NP = z_NP + b_in_PM[tree_P, node_NP].astype(jnp.float32)
    nodes.append(node_NP)
    logits.append(z_NP)
    node_NP = next_node(node_NP, z_NP)
  return jnp.stack(nodes, -1), jnp.stack(logits, -1)


def gathered(x_ND, w_in_PMD, b_in_PM, node_NP, n_levels, rows_per_chunk):
  """Walks n_levels levels down from node_NP, gathering one w_in row per (token, tree) per level.

  A `lax.scan` over chunks of tokens keeps a chunk's gathered rows (about rows_per_chunk of them) in cache
  on a CPU (elsewhere one chunk holds every token). Returns the nodes and logits [N, P, n_levels].
  """
  n_tokens = x_ND.shape[0]
  P = w_in_PMD.shape[0]
  tree_P = jnp.arange(P)
  x_KcD, node_KcP = chunked([x_ND, node_NP], platform.cpu_chunk(max(1, rows_per_chunk // P), n_tokens))

  def walk(_, xs):
    x_cD, node_cP = xs
    nodes, logits = [], []
    for _level in range(n_levels):
      w_cPD = w_in_PMD[tree_P, node_cP].astype(x_cD.dtype)
      z_cP = jnp.einsum("cd,cpd->cp", x_cD, w_cPD, preferred_element_type=jnp.float32)
      z_cP = z_cP + b_in_PM[tree_P, node_cP].astype(jnp.float32)
      nodes.append(node_cP)
      logits.append(z_cP)
      node_cP = next_node(node_cP, z_cP)
    return None, (jnp.stack(nodes, -1), jnp.stack(logits, -1))

  _, (path, z) = jax.lax.scan(walk, None, (x_KcD, node_KcP))
  return unchunk(path, n_tokens), unchunk(z, n_tokens)
