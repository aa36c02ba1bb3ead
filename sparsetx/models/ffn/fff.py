"""FFF: fast feed-forward layers, P parallel hard-routed binary trees of depth D (FFF seed paper, Sec. 3).

Each tree holds `2**(D+1) - 1` nodes in heap order, node = (w_in, b_in, w_out). Per token and tree,
start at the root; at each of the D+1 levels evaluate z = <x, w_in> + b_in and go to child
`2s + 2` if z > 0 else `2s + 1` (a logit of exactly 0 goes left). Then
  fff:       y = b_out + sum_p sum_levels GELU(z) * w_out
  fff_post:  y = GELU(b_out + sum_p sum_levels z * w_out).
No gradient flows through the routing decision. GELU is the exact erf form, as the FFF paper's code and
UltraFastBERT (torch's default nn.GELU) compute it; `ffn.gelu_approximate=True` gives the tanh form.

Two implementations that agree in values and gradients:
  sparse        kernels/tree_route.py: the top DENSE_LEVELS levels (7 nodes per tree) by one dense matmul, deeper
                levels by gathering one row per (token, tree, level); their outputs through the shared
                gated gather (rows tree * n_nodes + node, gates 1, bias b_in) fed the walk's logits;
  masked_dense  evaluates every node and masks with the path (the paper's analysis form; a reference).

Expert parallelism (sparse implementation, a mesh in the context whose `tree` axes have size
E > 1, see sparsetx/parallel/expert_parallel.py): trees are split over the expert group, P/E per
device, and one shard_map moves tokens, not nodes. Each device all-gathers the tokens of its group,
walks its own trees for them (routing never leaves a tree), computes their path nodes with the
gated gather, and reduce-scatters the [tokens, D] partial sums; the path nodes and logits return
to the tokens' owners by all-to-all. b_out and the fff_post GELU are applied after the sum. Bytes
a device sends per own token and layer, b bytes per activation, E the expert-axis size when it also
splits the batch: forward (E-1)*D*b (x) + (E-1)*D*4 (y, summed in float32) + (E-1)/E*P*(D+1)*8
(path ids and logits); backward (E-1)*D*4 (dy) + (E-1)*D*4 (dx, float32). The tables' d_model axis
(fsdp) is all-gathered for the layer like any FSDP weight.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sparsetx.config import ffn_checks
from sparsetx.kernels.gated_gather import options_from_config
from sparsetx.kernels.reference import identity
from sparsetx.kernels.tree_route import next_node, sparse_forward
from sparsetx.models.ffn.common import gelu_for, gini, symmetric_uniform
from sparsetx.models.ffn.spec import Circuit, FfnSpec, Units, dense_width
from sparsetx.parallel import expert_parallel as ep


def n_nodes(depth: int) -> int:
  return 2 ** (depth + 1) - 1


def masked_dense_forward(x_BTD, w_in_PND, b_in_PN, depth: int):
  """Every node's logit Z [B,T,P,N] and the path mask M [B,T,P,N] (one node per level)."""
  z_BTPN = jnp.einsum("btd,pnd->btpn", x_BTD, w_in_PND.astype(x_BTD.dtype), preferred_element_type=jnp.float32)
  z_BTPN = z_BTPN + b_in_PN[None, None].astype(jnp.float32)
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
    w_out = self.param(
      "w_out", nn.with_logical_partitioning(out_init, ("tree", "node", "embed")), (P, N, D), param_dtype
    )
    b_out = self.param("b_out", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (D,), param_dtype)

    gelu = gelu_for(ffn)
    act = gelu if ffn.variant == "fff" else identity
    group = None
    if ffn.implementation == "sparse":
      group = ep.expert_group("tree", P, x_BTD.shape[0] * x_BTD.shape[1], "config.model.ffn.n_trees")
    if group is not None:
      y_BTD, path_BTPL, z_BTPL = _expert_parallel(group, x_BTD, w_in, b_in, w_out, act, ffn)
    elif ffn.implementation == "sparse":
      B, T = x_BTD.shape[:2]
      y_ND, path_NPL, z_NPL = sparse_forward(
        x_BTD.reshape(B * T, D), w_in, b_in, w_out, ffn.depth, act, options_from_config(ffn.get("kernel"))
      )
      y_BTD, path_BTPL, z_BTPL = y_ND.reshape(B, T, D), path_NPL.reshape(B, T, P, L), z_NPL.reshape(B, T, P, L)
    else:
      z_BTPN, mask_BTPN, path_BTPL = masked_dense_forward(x_BTD, w_in, b_in, ffn.depth)
      z_BTPL = jnp.take_along_axis(z_BTPN, path_BTPL, axis=-1)
      a_BTPN = (mask_BTPN * act(z_BTPN)).astype(dtype)
      y_BTD = jnp.einsum("btpn,pnd->btd", a_BTPN, w_out.astype(dtype), preferred_element_type=jnp.float32)
    self.sow("intermediates", "path_nodes", path_BTPL)  # recorded, not patchable: routing is the forward pass
    self.sow("intermediates", "node_logits", z_BTPL)

    y_BTD = y_BTD + b_out[None, None].astype(jnp.float32)
    if ffn.variant == "fff_post":
      y_BTD = gelu(y_BTD)
    return y_BTD.astype(dtype)


def _expert_parallel(group, x_BTD, w_in_PND, b_in_PN, w_out_PND, act, ffn):
  """Sparse FFF with trees split over the expert group: (y [B,T,D] f32, path and logits [B,T,P,L])."""
  B, T, D = x_BTD.shape
  P, L = w_in_PND.shape[0], ffn.depth + 1
  options = options_from_config(ffn.get("kernel"))

  def local(x_nD, w_in_pND, b_in_pN, w_out_pND):
    x_gD = ep.gather_tokens(x_nD, group)
    y_gD, path_gpL, z_gpL = sparse_forward(x_gD, w_in_pND, b_in_pN, w_out_pND, ffn.depth, act, options)
    return ep.scatter_back(y_gD, group), ep.from_owners(path_gpL, group, 1), ep.from_owners(z_gpL, group, 1)

  tokens, trees = group.token_spec, PartitionSpec(group.unit_spec)
  y_ND, path_NPL, z_NPL = ep.shard_map(
    local, group, in_specs=(tokens, trees, trees, trees), out_specs=(tokens, tokens, tokens)
  )(x_BTD.reshape(B * T, D), w_in_PND, b_in_PN, w_out_PND)
  return y_ND.reshape(B, T, D), path_NPL.reshape(B, T, P, L), z_NPL.reshape(B, T, P, L)


LADDER_DEPTH = 6  # the FFF paper's preferred trade-off: 7 of 127 nodes per tree active (models/ladder.py)


def fff_balance(counts_PN) -> dict:
  """FFF routing balance from per-node visit counts [trees, 2**(depth+1) - 1] (heap order; the left child
  of node n is 2n + 1, so every odd node is a left turn)."""
  counts_PN = jnp.asarray(counts_PN, jnp.float32)
  n = counts_PN.shape[-1]
  depth = int(math.log2(n + 1)) - 1
  leaves_PL = counts_PN[:, n // 2 :]
  stats = dict(gini=gini(leaves_PL.reshape(-1)))
  for level in range(1, depth + 1):
    stats[f"gini_level_{level}"] = gini(counts_PN[:, 2**level - 1 : 2 ** (level + 1) - 1].reshape(-1))
  stats["leftmost_leaf_share"] = (leaves_PL[:, 0] / jnp.maximum(counts_PN[:, 0], 1e-9)).mean()  # roots see every token
  stats["left_turns"] = counts_PN[:, 1::2].sum() / jnp.maximum(counts_PN[:, 1:].sum(), 1e-9)
  return stats


def _usage_stats(ffn, counts_U, taps: dict, token_weights_BT) -> dict:
  """Balance over the leaves (its Gini replaces the one over all nodes), per level, and the path entropy."""
  P, N = ffn.n_trees, n_nodes(ffn.depth)
  leaves_PN = counts_U.reshape(P, N)[:, N // 2 :]
  p = leaves_PN / jnp.maximum(leaves_PN.sum(-1, keepdims=True), 1e-9)
  entropy = -(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0)).sum(-1)
  return dict(**fff_balance(counts_U.reshape(P, N)), path_entropy=entropy.mean())


def _params(model, ffn) -> tuple[int, int]:
  per_node = 2 * model.d_model + 1  # w_in, w_out rows and b_in
  return ffn.n_trees * n_nodes(ffn.depth) * per_node + model.d_model, ffn.n_trees * (
    ffn.depth + 1
  ) * per_node + model.d_model


SPEC = FfnSpec(
  name="fff",
  module=Fff,
  fields=("depth", "n_trees", "variant", "implementation", "gelu_approximate", "kernel"),
  check=ffn_checks.check_fff,
  params=_params,
  flops=lambda model, ffn: 2 * ffn.n_trees * (ffn.depth + 1) * 2 * model.d_model,
  ladder_size=lambda d_model: dict(depth=LADDER_DEPTH, n_trees=max(1, dense_width(d_model) // 128)),
  served_names=("path_nodes", "node_logits"),
  torch_class="Fff",
  units=Units("tree", "n_trees", ("tree", "node", "embed")),
  # A path is a set of nodes: one block of n_nodes per tree, every visited node weighs 1.
  circuit=Circuit(
    "path_nodes",
    "node_logits",
    size=lambda ffn: ffn.n_trees * n_nodes(ffn.depth),
    block=lambda ffn: n_nodes(ffn.depth),
    weighted=False,
    patchable=False,
    tree_paths=True,
  ),
  usage_stats=_usage_stats,
)
