"""FFF: fast feed-forward layers, P parallel hard-routed binary trees of depth D (FFF seed paper, Sec. 3).

More: docs/modules.md, sparsetx/models/ffn/fff.py.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sparsetx import scopes
from sparsetx.config import ffn_checks
from sparsetx.config.placements import placement_of
from sparsetx.kernels.fff.tree_route import DENSE_LEVELS, next_node
from sparsetx.kernels.rows.gated_gather import options_from_config
from sparsetx.kernels.rows.reference import identity
from sparsetx.models.ffn.common import gelu_for, gini, symmetric_uniform
from sparsetx.models.ffn.spec import Circuit, FfnSpec, Units, dense_width
from sparsetx.parallel import sparse_forms, tables
from sparsetx.perf import cost

TABLE_AXES = ("tree", "node", "embed")  # w_in, w_out [P, n_nodes, d_model]
BIAS_AXES = ("tree", "node")  # b_in [P, n_nodes]


def n_nodes(depth: int) -> int:
  return 2 ** (depth + 1) - 1


def masked_dense_forward(x_BTD, w_in_PZD, b_in_PZ, depth: int):
  """Every node's logit [B,T,P,Z] and the path mask [B,T,P,Z] (one node per level)."""
  z_BTPZ = jnp.einsum("btd,pzd->btpz", x_BTD, w_in_PZD.astype(x_BTD.dtype), preferred_element_type=jnp.float32)
  z_BTPZ = z_BTPZ + b_in_PZ[None, None].astype(jnp.float32)
  frozen_BTPZ = jax.lax.stop_gradient(z_BTPZ)
  node_BTP = jnp.zeros(z_BTPZ.shape[:3], jnp.int32)
  nodes = []
  for _ in range(depth + 1):
    nodes.append(node_BTP)
    z_BTP = jnp.take_along_axis(frozen_BTPZ, node_BTP[..., None], axis=-1)[..., 0]
    node_BTP = next_node(node_BTP, z_BTP)
  path_BTPL = jnp.stack(nodes, axis=-1)
  mask_BTPZ = jax.nn.one_hot(path_BTPL, z_BTPZ.shape[-1], dtype=jnp.float32).sum(axis=-2)
  return z_BTPZ, mask_BTPZ, path_BTPL


class Fff(nn.Module):
  cfg: object  # the model config (FrozenConfigDict)

  @nn.compact
  def __call__(self, x_BTD):
    ffn = self.cfg.ffn
    P, L, D = ffn.n_trees, ffn.depth + 1, self.cfg.d_model
    Z = n_nodes(ffn.depth)
    dtype, param_dtype = jnp.dtype(self.cfg.dtype), jnp.dtype(self.cfg.param_dtype)
    placement = placement_of(ffn)  # masked_dense: the compiler moves the tables as they are stored
    in_init = symmetric_uniform(1.0 / D**0.5)
    # The sparse walk's trees are the dispatcher's blocks (a device's own trees) under placement expert; d_model is
    # gathered like any FSDP weight's. The masked dense forward reads the tables whole.
    local = ("tree",) if ffn.implementation == "sparse" else ()
    tree_table = functools.partial(tables.table_param, self, dtype=param_dtype, local=local, placement=placement)
    w_in = tree_table("w_in", in_init, (P, Z, D), axes=TABLE_AXES)
    b_in = tree_table("b_in", in_init, (P, Z), axes=BIAS_AXES)
    out_init = symmetric_uniform(1.0 / (L * P) ** 0.5)
    w_out = tree_table("w_out", out_init, (P, Z, D), axes=TABLE_AXES)
    b_out = self.param("b_out", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (D,), param_dtype)

    gelu = gelu_for(ffn)
    act = gelu if ffn.variant == "fff" else identity
    if ffn.implementation == "sparse":
      options = options_from_config(ffn.get("kernel"))
      with jax.named_scope(scopes.ROUTER):  # the walk down the trees; its last gather counts as row gathers
        y_BTD, path_BTPL, z_BTPL = sparse_forms.tree_walk(
          x_BTD,
          w_in,
          b_in,
          w_out,
          ffn.depth,
          act,
          options,
          table_axes=TABLE_AXES,
          placement=placement,
          bias_axes=BIAS_AXES,
        )
    else:
      z_BTPZ, mask_BTPZ, path_BTPL = masked_dense_forward(x_BTD, w_in, b_in, ffn.depth)
      z_BTPL = jnp.take_along_axis(z_BTPZ, path_BTPL, axis=-1)
      a_BTPZ = (mask_BTPZ * act(z_BTPZ)).astype(dtype)
      y_BTD = jnp.einsum("btpz,pzd->btd", a_BTPZ, w_out.astype(dtype), preferred_element_type=jnp.float32)
    self.sow("intermediates", "path_nodes", path_BTPL)  # recorded, not patchable: routing is the forward pass
    self.sow("intermediates", "node_logits", z_BTPL)

    y_BTD = y_BTD + b_out[None, None].astype(jnp.float32)
    if ffn.variant == "fff_post":
      y_BTD = gelu(y_BTD)
    return y_BTD.astype(dtype)


LADDER_DEPTH = 6  # the FFF paper's preferred trade-off: 7 of 127 nodes per tree active (models/ladder.py)


def fff_balance(counts_PZ) -> dict:
  """FFF routing balance from per-node visit counts [trees, 2**(depth+1) - 1] (heap order; the left child
  of node n is 2n + 1, so every odd node is a left turn)."""
  counts_PZ = jnp.asarray(counts_PZ, jnp.float32)
  n = counts_PZ.shape[-1]
  depth = int(math.log2(n + 1)) - 1
  leaves_PL = counts_PZ[:, n // 2 :]
  stats = dict(gini=gini(leaves_PL.reshape(-1)))
  for level in range(1, depth + 1):
    stats[f"gini_level_{level}"] = gini(counts_PZ[:, 2**level - 1 : 2 ** (level + 1) - 1].reshape(-1))
  stats["leftmost_leaf_share"] = (leaves_PL[:, 0] / jnp.maximum(counts_PZ[:, 0], 1e-9)).mean()  # roots see every token
  stats["left_turns"] = counts_PZ[:, 1::2].sum() / jnp.maximum(counts_PZ[:, 1:].sum(), 1e-9)
  return stats


def _usage_stats(ffn, counts_U, taps: dict, token_weights_BT) -> dict:
  """Balance over the leaves (its Gini replaces the one over all nodes), per level, and the path entropy."""
  P, Z = ffn.n_trees, n_nodes(ffn.depth)
  leaves_PZ = counts_U.reshape(P, Z)[:, Z // 2 :]
  p = leaves_PZ / jnp.maximum(leaves_PZ.sum(-1, keepdims=True), 1e-9)
  entropy = -(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0)).sum(-1)
  return dict(**fff_balance(counts_U.reshape(P, Z)), path_entropy=entropy.mean())


def _params(model, ffn) -> tuple[int, int]:
  per_node = 2 * model.d_model + 1  # w_in, w_out rows and b_in
  return ffn.n_trees * n_nodes(ffn.depth) * per_node + model.d_model, ffn.n_trees * (
    ffn.depth + 1
  ) * per_node + model.d_model


def fff_cost(bld, model, ffn, n, E, G, b, devices):
  """FFF: top DENSE_LEVELS levels as matmuls against their 7 nodes per tree, one row_dots per deeper level, the
  deeper levels' outputs through row_accumulate, the tree walk's gradients as the gated gather's."""

  D, P, L = model.d_model, ffn.n_trees // E, ffn.depth + 1
  Z = 2 ** (ffn.depth + 1) - 1
  top = min(DENSE_LEVELS, L)
  n_top, deep = 2**top - 1, L - top
  N, R = n * E, P * Z
  bld.cast(2 * R * D, b)
  bld.table_bytes = 2 * R * D * b
  bld.fsdp(R * 2 * D, G, "tables over fsdp (FSDP)", placed=True)
  if top:
    bld.matmul("top levels: logits (dense)", N, D, P * n_top, b, b, cost.F32)
    bld.matmul("top levels: outputs (dense)", N, P * n_top, D, b, b, cost.F32)
  if deep:
    level = (
      N * P * D * b + N * D * b + 2 * N * P * cost.INDEX + 2 * N * P * cost.F32
    )  # rows, x, node ids, b_in, z, next ids
    bld.add(f"walk: {deep} x row_dots (S={P})", deep * level, deep * 2 * N * P * D, forward=True)
    chunk = ffn.kernel.get("segment_chunk", 0)
    cost.gather_kernels(bld, N, P * deep, D, b, R, with_bias=True, forward_dots=False, segment_chunk=chunk)
  tables = bld.tables((R * 2 * D) / G, devices // (E * G))
  bld.optimizer(tables + R + D)
  bld.grad_sync(R + D, devices // (E * G))  # b_in, b_out
  tokens = functools.partial(bld.collective, placed=True)
  tokens("all-gather", N * D * b, E, "x to the expert group", forward=True)
  tokens("reduce-scatter", n * D * cost.F32, E, "y partial sums (float32)", forward=True)
  tokens("all-to-all", n * ffn.n_trees * L * (cost.INDEX + cost.F32), E, "path nodes and logits back", forward=True)
  tokens("all-gather", N * D * cost.F32, E, "dy to the expert group (float32)")
  tokens("reduce-scatter", n * D * cost.F32, E, "dx partial sums (float32)")


def leaf_counts(ffn, counts_U) -> np.ndarray:
  """Picks per leaf of each tree, from its node counts in heap order (the leaves the last half)."""
  return np.asarray(counts_U).reshape(ffn["n_trees"], -1)[:, 2 ** ffn["depth"] - 1 :]


def _leaf_window_stats(leaves_PL) -> dict:
  """How concentrated the trees' paths are: the top leaf's share and the leaf distribution's entropy (bits)."""
  share_PL = leaves_PL / np.maximum(leaves_PL.sum(1, keepdims=True), 1e-30)
  entropy_P = -np.sum(np.where(share_PL > 0, share_PL * np.log2(np.where(share_PL > 0, share_PL, 1.0)), 0.0), 1)
  return dict(top_leaf_share=float(share_PL.max(1).mean()), path_entropy=float(entropy_P.mean()))


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
  cost=fff_cost,
  residual_bytes=lambda model, ffn, tokens, itemsize: tokens * ffn.n_trees * (ffn.depth + 1) * 8,  # node ids, logits
  units=Units("tree", "n_trees", TABLE_AXES),
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
  window_stats=lambda ffn, counts_U: _leaf_window_stats(leaf_counts(ffn, counts_U)),
  count_rows=lambda ffn, counts_U: leaf_counts(ffn, counts_U),
)
