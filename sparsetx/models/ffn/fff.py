"""FFF: fast feed-forward layers, P parallel hard-routed binary trees of depth D (FFF seed paper, Sec. 3).

Each tree holds `2**(D+1) - 1` nodes in heap order, node = (w_in, b_in, w_out). Per token and tree,
start at the root; at each of the D+1 levels evaluate z = <x, w_in> + b_in and go to child
`2s + 2` if z > 0 else `2s + 1` (a logit of exactly 0 goes left). Then
  fff:       y = b_out + sum_p sum_levels GELU(z) * w_out
  fff_post:  y = GELU(b_out + sum_p sum_levels z * w_out).
No gradient flows through the routing decision.

Two implementations that agree in values and gradients:
  sparse        gathers only the D+1 path nodes per tree (what runs);
  masked_dense  evaluates every node and masks with the path (the paper's analysis form; a reference).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.models.ffn.common import gelu, symmetric_uniform


def n_nodes(depth: int) -> int:
  return 2 ** (depth + 1) - 1


def next_node(node, z):
  """Heap-order child: right (2s + 2) when z > 0, else left (2s + 1)."""
  return 2 * node + 1 + (z > 0).astype(node.dtype)


def sparse_forward(x_BTD, w_in_PND, b_in_PN, depth: int):
  """Walks the trees gathering one node per level: (logits z [B,T,P,L], path node ids [B,T,P,L])."""
  B, T, _ = x_BTD.shape
  P = w_in_PND.shape[0]
  tree_P = jnp.arange(P)
  node_BTP = jnp.zeros((B, T, P), jnp.int32)
  nodes, logits = [], []
  for _ in range(depth + 1):
    w_BTPD = w_in_PND[tree_P, node_BTP].astype(x_BTD.dtype)
    z_BTP = jnp.einsum("btd,btpd->btp", x_BTD, w_BTPD, preferred_element_type=jnp.float32)
    z_BTP = z_BTP + b_in_PN[tree_P, node_BTP].astype(jnp.float32)
    nodes.append(node_BTP)
    logits.append(z_BTP)
    node_BTP = next_node(node_BTP, jax.lax.stop_gradient(z_BTP))
  path_BTPL = jnp.stack(nodes, axis=-1)
  return jnp.stack(logits, axis=-1), path_BTPL


def masked_dense_forward(x_BTD, w_in_PND, b_in_PN, depth: int):
  """Every node's logit Z [B,T,P,N] and the path mask M [B,T,P,N] (one node per level)."""
  z_BTPN = jnp.einsum("btd,pnd->btpn", x_BTD, w_in_PND.astype(x_BTD.dtype), preferred_element_type=jnp.float32)
  z_BTPN = z_BTPN + b_in_PN.astype(jnp.float32)
  frozen_BTPN = jax.lax.stop_gradient(z_BTPN)
  node_BTP = jnp.zeros(z_BTPN.shape[:3], jnp.int32)
  nodes = []
  for _ in range(depth + 1):
    nodes.append(node_BTP)
    z_BTP = jnp.take_along_axis(frozen_BTPN, node_BTP[..., None], axis=-1)[..., 0]
    node_BTP = next_node(node_BTP, z_BTP)
  path_BTPL = jnp.stack(nodes, axis=-1)
  mask_BTPN = jax.nn.one_hot(path_BTPL, z_BTPN.shape[-1], dtype=jnp.float32).sum(axis=-2)
  return z_BTPN, mask_BTPN, path_BTPL


class Fff(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    P, L, D = ffn.n_trees, ffn.depth + 1, self.cfg.d_model
    N = n_nodes(ffn.depth)
    dtype, param_dtype = jnp.dtype(self.cfg.dtype), jnp.dtype(self.cfg.param_dtype)
    in_init = symmetric_uniform(1.0 / D**0.5)
    w_in = self.param("w_in", nn.with_logical_partitioning(in_init, ("tree", "node", "embed")), (P, N, D), param_dtype)
    b_in = self.param("b_in", nn.with_logical_partitioning(in_init, ("tree", "node")), (P, N), param_dtype)
    out_init = symmetric_uniform(1.0 / (L * P) ** 0.5)
    w_out = self.param("w_out", nn.with_logical_partitioning(out_init, ("tree", "node", "embed")), (P, N, D), param_dtype)
    b_out = self.param("b_out", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (D,), param_dtype)

    act = gelu if ffn.variant == "fff" else (lambda z: z)
    if ffn.implementation == "sparse":
      z_BTPL, path_BTPL = sparse_forward(x_BTD, w_in, b_in, ffn.depth)
      w_out_BTPLD = w_out[jnp.arange(P)[:, None], path_BTPL].astype(dtype)
      y_BTD = jnp.einsum("btpl,btpld->btd", act(z_BTPL).astype(dtype), w_out_BTPLD, preferred_element_type=jnp.float32)
    else:
      z_BTPN, mask_BTPN, path_BTPL = masked_dense_forward(x_BTD, w_in, b_in, ffn.depth)
      z_BTPL = jnp.take_along_axis(z_BTPN, path_BTPL, axis=-1)
      a_BTPN = (mask_BTPN * act(z_BTPN)).astype(dtype)
      y_BTD = jnp.einsum("btpn,pnd->btd", a_BTPN, w_out.astype(dtype), preferred_element_type=jnp.float32)
    self.sow("intermediates", "path_nodes", path_BTPL)  # recorded, not patchable: routing is the forward pass
    self.sow("intermediates", "node_logits", z_BTPL)

    y_BTD = y_BTD + b_out.astype(jnp.float32)
    if ffn.variant == "fff_post":
      y_BTD = gelu(y_BTD)
    return y_BTD.astype(dtype)
