"""The parameters in groups a researcher watches apart: per-group gradient and update norms of each step.

tables      the feed-forward weights beside the router: neuron tables (sgatlin, PEER), experts (MoE), tree nodes
            (FFF), dense MLP and SwiGLU weights
routers     what picks them: sgatlin's query and sub-keys, PEER's, MoE's router, the selection biases
attention   query, key, value and output projections
embeddings  the token embedding and the LM head
norms       every normalization's scale and bias
"""

import jax
import jax.numpy as jnp

from sparsetx.models.ffn import selection_bias

GROUPS = ("tables", "routers", "attention", "embeddings", "norms")


def group_of(path: tuple[str, ...]) -> str:
  """The group of the parameter at a flax path, e.g. ('layers_0', 'mlp', 'router', 'keys', 'kernel') -> routers."""
  if any(part.endswith("norm") for part in path):
    return "norms"
  if path[0] in ("embed", "lm_head"):
    return "embeddings"
  if "attention" in path:
    return "attention"
  if "router" in path or path[-1] == selection_bias.NAME:  # the selection bias routes too
    return "routers"
  return "tables"


def group_norms(tree) -> dict[str, jax.Array]:
  """{group: the L2 norm of its leaves of `tree` (gradients, updates)}, for the groups the tree has."""
  squares = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    group = group_of(tuple(str(getattr(key, "key", key)) for key in path))
    squares[group] = squares.get(group, 0.0) + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
  return {group: jnp.sqrt(value) for group, value in squares.items()}
