"""FFF routing: the level-by-level walk down P binary trees, chunked over tokens (no gradient).

Each level's node depends on the previous level's logit, so the walk is sequential in depth; per
level it gathers one `w_in` row per (token, tree). A `lax.scan` over token chunks keeps the
gathered rows of a chunk in cache instead of materializing [tokens, P, D] per level. The node
outputs and all gradients then come from the gated gather over the path rows (gated_gather.py),
which recomputes the same logits with a differentiable dot.
"""

import jax
import jax.numpy as jnp


def next_node(node, z):
  """Heap-order child: right (2s + 2) when z > 0, else left (2s + 1); a logit of exactly 0 goes left."""
  return 2 * node + 1 + (z > 0).astype(node.dtype)


def tree_paths(x_ND, w_in_PMD, b_in_PM, depth, token_chunk):
  """Path node ids [N, P, depth + 1] (int32) and their logits [N, P, depth + 1] (float32)."""
  x_ND, w_in_PMD, b_in_PM = jax.lax.stop_gradient((x_ND, w_in_PMD, b_in_PM))
  n_tokens, D = x_ND.shape
  P = w_in_PMD.shape[0]
  tree_P = jnp.arange(P)
  n_padded = -(-n_tokens // token_chunk) * token_chunk
  x_KcD = jnp.pad(x_ND, ((0, n_padded - n_tokens), (0, 0))).reshape(-1, token_chunk, D)

  def walk(_, x_cD):
    node_cP = jnp.zeros((token_chunk, P), jnp.int32)
    nodes, logits = [], []
    for _level in range(depth + 1):
      w_cPD = w_in_PMD[tree_P, node_cP].astype(x_cD.dtype)
      z_cP = jnp.einsum("cd,cpd->cp", x_cD, w_cPD, preferred_element_type=jnp.float32)
      z_cP = z_cP + b_in_PM[tree_P, node_cP].astype(jnp.float32)
      nodes.append(node_cP)
      logits.append(z_cP)
      node_cP = next_node(node_cP, z_cP)
    return None, (jnp.stack(nodes, -1), jnp.stack(logits, -1))

  _, (path, z) = jax.lax.scan(walk, None, x_KcD)
  return path.reshape(n_padded, P, depth + 1)[:n_tokens], z.reshape(n_padded, P, depth + 1)[:n_tokens]
