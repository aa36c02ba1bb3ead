"""Per-layer usage statistics of the sparse feed-forward layers, from the circuits they tap.

Computed inside the jitted step from the `intermediates` the layers sow (unused taps are removed
by XLA's dead-code elimination). Counts only real tokens (loss weight > 0).
  used      fraction of neurons (sgatlin, PEER), nodes (FFF) or experts (MoE) picked at least once
  gini      Gini coefficient of the usage counts (0 = uniform, 1 = one unit takes everything); for FFF
            over the leaves of all trees, so a balanced tree scores 0 at any depth (over all nodes it
            would not: the root sees every token, a leaf a fraction)
  gini_level_l  FFF: Gini over the nodes of level l (1 = the root's children .. depth = the leaves)
  leftmost_leaf_share  FFF: share of tokens reaching each tree's leftmost leaf (balanced: 2**-depth),
            averaged over trees; left_turns: fraction of routing decisions going left (balanced: 0.5)
  path_entropy  FFF: entropy in bits of the leaf distribution, averaged over trees (max = depth)
  max_load  MoE: the busiest expert's share of routed tokens times n_experts (1 = balanced)
  aux_loss, router_z_loss  MoE: the Switch load-balancing value N * sum f_i P_i (1 = balanced) and the router
            z-loss mean(logsumexp(logits)**2), unweighted (models/ffn/moe.py)
"""

import math

import jax.numpy as jnp

from sparsetx import config as config_lib
from sparsetx.models.ffn import moe


def gini(counts):
  """Gini coefficient of non-negative counts along the last axis."""
  x = jnp.sort(counts.astype(jnp.float32), axis=-1)
  n = x.shape[-1]
  ranks = jnp.arange(1, n + 1, dtype=jnp.float32)
  total = jnp.maximum(x.sum(-1), 1e-9)
  return (2.0 * (ranks * x).sum(-1) / (n * total)) - (n + 1.0) / n


def usage_counts(ids, weights_per_id, size: int):
  """How often each of `size` units was picked: a weighted bincount."""
  return jnp.zeros((size,), jnp.float32).at[ids.reshape(-1)].add(weights_per_id.reshape(-1))


def fff_balance(counts_PN) -> dict:
  """FFF routing balance from per-node visit counts [trees, 2**(depth+1) - 1] (heap order; the left child
  of node n is 2n + 1, so every odd node is a left turn)."""
  counts_PN = jnp.asarray(counts_PN, jnp.float32)
  n_nodes = counts_PN.shape[-1]
  depth = int(math.log2(n_nodes + 1)) - 1
  leaves_PL = counts_PN[:, n_nodes // 2 :]
  stats = dict(gini=gini(leaves_PL.reshape(-1)))
  for level in range(1, depth + 1):
    stats[f"gini_level_{level}"] = gini(counts_PN[:, 2**level - 1 : 2 ** (level + 1) - 1].reshape(-1))
  stats["leftmost_leaf_share"] = (leaves_PL[:, 0] / jnp.maximum(counts_PN[:, 0], 1e-9)).mean()  # roots see every token
  stats["left_turns"] = counts_PN[:, 1::2].sum() / jnp.maximum(counts_PN[:, 1:].sum(), 1e-9)
  return stats


def layer_stats(ffn_cfg, taps: dict, token_weights_BT) -> dict:
  kind = ffn_cfg.type
  if kind in ("sgatlin", "peer"):
    idx_BTCK = taps["gate_indices"][0]
    C, K = idx_BTCK.shape[-2:]
    n = ffn_cfg.d_ffw
    if kind == "sgatlin":  # each channel owns its table: count (channel, neuron) units
      idx_BTCK = idx_BTCK + n * jnp.arange(C)[None, None, :, None]
      n = C * n
    w = jnp.broadcast_to(token_weights_BT[:, :, None, None], idx_BTCK.shape)
    counts = usage_counts(idx_BTCK, w, n)
    return dict(used=(counts > 0).mean(), gini=gini(counts))
  if kind == "fff":
    path_BTPL = taps["path_nodes"][0]
    P, L = path_BTPL.shape[-2:]
    n_nodes = 2**L - 1
    w = jnp.broadcast_to(token_weights_BT[:, :, None, None], path_BTPL.shape)
    counts = usage_counts(path_BTPL + n_nodes * jnp.arange(P)[None, None, :, None], w, P * n_nodes)
    leaves_PN = counts.reshape(P, n_nodes)[:, n_nodes // 2 :]
    p = leaves_PN / jnp.maximum(leaves_PN.sum(-1, keepdims=True), 1e-9)
    entropy = -(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0)).sum(-1)
    return dict(used=(counts > 0).mean(), **fff_balance(counts.reshape(P, n_nodes)), path_entropy=entropy.mean())
  if kind == "moe":
    ids_BTK = taps["expert_ids"][0]
    w = jnp.broadcast_to(token_weights_BT[:, :, None], ids_BTK.shape)
    counts = usage_counts(ids_BTK, w, ffn_cfg.n_experts)
    share = counts / jnp.maximum(counts.sum(), 1e-9)
    stats = dict(used=(counts > 0).mean(), gini=gini(counts), max_load=share.max() * ffn_cfg.n_experts)
    if "router_logits" in taps:  # the balancing losses' values (weighted into the loss by config.model.ffn)
      stats.update(moe.balance_losses(ffn_cfg.n_experts, taps["router_logits"][0], ids_BTK, token_weights_BT))
    return stats
  return {}


def sparse_stats(model_cfg, intermediates: dict, token_weights_BT) -> dict:
  """{'sparse/layers_i/<stat>': value} for every layer of a sparse feed-forward type."""
  stats = {}
  for i in range(model_cfg.n_layers):
    taps = intermediates.get(f"layers_{i}", {}).get("mlp", {})
    for name, value in layer_stats(config_lib.layer_ffn_config(model_cfg, i), taps, token_weights_BT).items():
      stats[f"sparse/layers_{i}/{name}"] = value
  return stats
