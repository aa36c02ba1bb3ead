"""FFF's sparse forward: the level-by-level walk down P binary trees and the outputs of its path nodes.

Per token and tree the walk evaluates one node per level, each depending on the previous level's
logit. Two facts make it fast on a CPU, and they hold on accelerators too; docs/modules.md states them.

More: docs/modules.md, sparsetx/kernels/fff/tree_route.py.
"""

import jax
import jax.numpy as jnp

from sparsetx.kernels import op_calls, registry
from sparsetx.kernels.fff.tree_walk import next_node  # noqa: F401 (FFF's layer reads it here)
from sparsetx.kernels.rows.gated_gather import gated_gather

DENSE_LEVELS = 3  # levels computed by one matmul (7 nodes per tree) before the walk starts gathering
WALK_ROWS_PER_CHUNK = 512  # gathered w_in rows per scan step of the walk (about 1.5 MiB at d_model 768)


def tree_paths(
  x_ND, w_in_PMD, b_in_PM, depth, dense_levels=DENSE_LEVELS, rows_per_chunk=WALK_ROWS_PER_CHUNK, options=None
):
  """Path node ids [N, P, depth + 1] (int32) and their logits [N, P, depth + 1] (float32), no gradient.

  Also returns the top levels' logits of every node [N, P, 2**top - 1] (float32, differentiable; None
  when no level is dense), which the forward reuses for those levels' outputs.
  """
  L = depth + 1
  top = min(dense_levels, L)
  n_top = 2**top - 1
  node_NP = jnp.zeros((x_ND.shape[0], w_in_PMD.shape[0]), jnp.int32)
  nodes, logits, z_top_NPM = [], [], None
  if top:
    z_top_NPM = jnp.einsum(
      "nd,pmd->npm", x_ND, w_in_PMD[:, :n_top].astype(x_ND.dtype), preferred_element_type=jnp.float32
    )
    z_top_NPM = z_top_NPM + b_in_PM[None, :, :n_top].astype(jnp.float32)
    frozen_NPM = jax.lax.stop_gradient(z_top_NPM)
    for _level in range(top):
      z_NP = jnp.take_along_axis(frozen_NPM, node_NP[..., None], axis=-1)[..., 0]
      nodes.append(node_NP[..., None])
      logits.append(z_NP[..., None])
      node_NP = next_node(node_NP, z_NP)
  if L > top:
    x_ND, w_in_PMD, b_in_PM = jax.lax.stop_gradient((x_ND, w_in_PMD, b_in_PM))
    options = registry.KernelOptions("xla") if options is None else options  # no options: XLA's walk
    call = op_calls.walk(x_ND, w_in_PMD, L - top, top)
    implementation = registry.rows(options, op_calls.shape_class(call), call)
    deep_path, deep_z = implementation.walk(options, x_ND, w_in_PMD, b_in_PM, node_NP, L - top, rows_per_chunk)
    nodes.append(deep_path)
    logits.append(deep_z)
  return jnp.concatenate(nodes, -1), jnp.concatenate(logits, -1), z_top_NPM


def sparse_forward(x_ND, w_in_PMD, b_in_PM, w_out_PMD, depth, activation, options, dense_levels=DENSE_LEVELS):
  """y [N, D] float32 = sum over trees and path nodes of act(z) * w_out, the path [N, P, L] and logits [N, P, L]."""
  P, M, D = w_in_PMD.shape
  L = depth + 1
  top = min(dense_levels, L)
  n_top = 2**top - 1
  path_NPL, z_NPL, z_top_NPM = tree_paths(x_ND, w_in_PMD, b_in_PM, depth, dense_levels, options=options)
  y_ND = jnp.zeros(x_ND.shape, jnp.float32)
  if top:
    # Each level visits one node of its own level, so the one-hot rows of the top path never overlap.
    mask_NPM = jax.nn.one_hot(path_NPL[..., :top], n_top, dtype=jnp.float32).sum(axis=-2)
    a_NPM = (mask_NPM * activation(z_top_NPM)).astype(x_ND.dtype)
    w_top_PMD = w_out_PMD[:, :n_top].astype(x_ND.dtype)
    y_ND = jnp.einsum("npm,pmd->nd", a_NPM, w_top_PMD, preferred_element_type=jnp.float32)
  if L > top:
    deep_NPL = path_NPL[..., top:]
    rows_NS = (deep_NPL + M * jnp.arange(P, dtype=jnp.int32)[None, :, None]).reshape(x_ND.shape[0], -1)
    flat = lambda table: table.reshape(P * M, D)  # noqa: E731
    y_ND = y_ND + gated_gather(
      x_ND,
      flat(w_in_PMD),
      flat(w_out_PMD),
      rows_NS,
      jnp.ones(rows_NS.shape, jnp.float32),
      activation,
      bias_R=b_in_PM.reshape(P * M),
      options=options,
      pre_activation=z_NPL[..., top:].reshape(rows_NS.shape),
      gate_inside_activation=False,  # gates 1: act(z) * w_out, the FFF formula as written
    ).astype(jnp.float32)
  return y_ND, path_NPL, z_NPL
