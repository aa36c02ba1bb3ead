"""The training loss: token cross-entropy with packing weights and z-loss, the LM head optionally one vocabulary tile
at a time, plus MoE's balancing losses; and one device's share of it inside the per-device micro-batch loop."""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sparsetx import config as config_lib
from sparsetx import scopes
from sparsetx.models import transformer
from sparsetx.models.ffn import moe
from sparsetx.train.tracking.sparse_stats import sparse_stats


def token_cross_entropy(logits_BTV, targets_BT, z_loss: float):
  """Cross-entropy + z_loss * logZ**2 of each token, from its float32 logits."""
  ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
  if z_loss:
    ce_BT = ce_BT + z_loss * jax.nn.logsumexp(logits_BTV, axis=-1) ** 2
  return ce_BT


def chunked_token_losses(cfg, params, hidden_BTD, targets_BT, z_loss: float, n_tiles: int):
  """`token_losses`' per-token loss [B,T] from the final-norm outputs, the LM head applied one vocabulary tile of
  ceil(V/n_tiles) columns at a time under a `lax.scan` with an online logsumexp (running max and rescaled sum, and
  the target's logit picked from its tile). The forward keeps only the [B,T] carries and the backward
  (`_log_z_and_target`) recomputes each tile's logits: one tile's [B, T, V/n] float32 logits are alive at a time
  instead of the whole [B, T, V]. A vocabulary n does not divide is padded with zero columns, masked out.

  Tiles of the vocabulary, not of the tokens: each tile's head gradient is its own columns (the data-parallel
  reduction of the head's gradient moves the same bytes as the plain loss's, in n pieces), and the batch keeps its
  sharding. Same math as the plain loss; the sums over the vocabulary are taken per tile, then over tiles."""
  # Cast before the loop to the head's dot dtype (transformer.head_dtype), as head_logits casts: the backward
  # rounds the head gradient to the parameters' dtype once, as the plain loss does.
  dtype = transformer.head_dtype(cfg)
  x_BTD = hidden_BTD.astype(dtype)
  head = jax.tree.map(lambda w: w.astype(dtype), transformer.head_params(cfg, params))
  V = cfg.vocab_size
  v = -(-V // n_tiles)
  if cfg.tie_embeddings:
    w_VD = jnp.pad(head["embed"]["embedding"], ((0, n_tiles * v - V), (0, 0)))
    tiles = w_VD.reshape(n_tiles, v, w_VD.shape[1])  # [n, v, D]
    spec = "btd,vd->btv"
  else:
    w_DV = jnp.pad(head["lm_head"]["kernel"], ((0, 0), (0, n_tiles * v - V)))
    tiles = jnp.moveaxis(w_DV.reshape(w_DV.shape[0], n_tiles, v), 1, 0)  # [n, D, v]
    spec = "btd,dv->btv"
  log_z_BT, target_BT = _log_z_and_target(_Head(cfg, spec, V, v), x_BTD, tiles, targets_BT)
  ce_BT = log_z_BT - target_BT
  if z_loss:
    ce_BT = ce_BT + z_loss * log_z_BT**2
  return ce_BT


class _Head(NamedTuple):
  """The static side of the chunked head: the model config, the dot's einsum spec, the real vocabulary size and the
  columns of a tile."""

  cfg: object
  spec: str
  vocab_size: int
  width: int

  def logits(self, x_BTD, w_tile, first):
    """One tile's float32 logits [B, T, v] and its columns' vocabulary ids [v]; the padding's columns -inf."""
    logits_BTv = nn.with_logical_constraint(
      transformer.head_dot(self.cfg, self.spec, x_BTD, w_tile), ("batch", "length", "vocab")
    )
    column_v = first + jnp.arange(self.width)
    return jnp.where((column_v < self.vocab_size)[None, None, :], logits_BTv, -jnp.inf), column_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _log_z_and_target(head: _Head, x_BTD, tiles, targets_BT):
  """(logsumexp of each token's logits, its target's logit), both [B, T] float32, over the vocabulary tiles."""
  return _log_z_and_target_fwd(head, x_BTD, tiles, targets_BT)[0]


def _log_z_and_target_fwd(head, x_BTD, tiles, targets_BT):
  B, T, _ = x_BTD.shape

  def tile(carry, xs):
    max_BT, sum_BT, target_BT = carry
    logits_BTv, column_v = head.logits(x_BTD, *xs)
    new_max_BT = jnp.maximum(max_BT, logits_BTv.max(-1))
    sum_BT = sum_BT * jnp.exp(max_BT - new_max_BT) + jnp.exp(logits_BTv - new_max_BT[..., None]).sum(-1)
    hit_BTv = column_v[None, None, :] == targets_BT[..., None]
    target_BT = target_BT + jnp.where(hit_BTv, logits_BTv, 0.0).sum(-1)
    return (new_max_BT, sum_BT, target_BT), None

  start = (jnp.full((B, T), -jnp.inf), jnp.zeros((B, T)), jnp.zeros((B, T)))
  firsts = jnp.arange(tiles.shape[0]) * head.width
  (max_BT, sum_BT, target_BT), _ = jax.lax.scan(tile, start, (tiles, firsts))
  log_z_BT = max_BT + jnp.log(sum_BT)
  return (log_z_BT, target_BT), (x_BTD, tiles, targets_BT, log_z_BT, firsts)


def _log_z_and_target_bwd(head, residuals, cotangents):
  """Each tile once more: its logits, their cotangent d log_z * softmax + d target * onehot (the padding's zero),
  then both gradient products as the head's own backward takes them (transformer.head_dot_grads). The hidden
  states' gradient sums over tiles in float32 and is rounded once."""
  x_BTD, tiles, targets_BT, log_z_BT, firsts = residuals
  dlog_z_BT, dtarget_BT = cotangents

  def tile(dx_BTD, xs):
    w_tile, first = xs
    logits_BTv, column_v = head.logits(x_BTD, w_tile, first)
    hit_BTv = column_v[None, None, :] == targets_BT[..., None]
    softmax_BTv = jnp.exp(logits_BTv - log_z_BT[..., None])
    g_BTv = dlog_z_BT[..., None] * softmax_BTv + jnp.where(hit_BTv, dtarget_BT[..., None], 0.0)
    dx_tile_BTD, dw_tile = transformer.head_dot_grads(head.spec, x_BTD, w_tile, g_BTv)
    return dx_BTD + dx_tile_BTD, dw_tile.astype(tiles.dtype)

  dx_BTD, dtiles = jax.lax.scan(tile, jnp.zeros(x_BTD.shape, jnp.float32), (tiles, firsts))
  return dx_BTD.astype(x_BTD.dtype), dtiles, None


_log_z_and_target.defvjp(_log_z_and_target_fwd, _log_z_and_target_bwd)


def token_losses(model, params, batch, z_loss: float, loss_chunks: int = 0):
  """Per-token loss [B,T] (cross-entropy + z_loss * logZ**2) and the model's intermediates.

  loss_chunks > 1 (config.train.loss_chunks): the head and loss run by `chunked_token_losses`, so the full
  logits never exist; the intermediates are the same but for the `logits` tap, which is then not taken."""
  n_chunks = config_lib.loss_chunk_count(model.cfg.vocab_size, loss_chunks)
  out, state = model.apply(
    {"params": params},
    batch["inputs"],
    batch["positions"],
    batch["segment_ids"],
    head=n_chunks == 1,
    mutable=["intermediates"],
  )
  with jax.named_scope(scopes.LOSS):
    if n_chunks == 1:
      return token_cross_entropy(out, batch["targets"], z_loss), state["intermediates"]
    ce_BT = chunked_token_losses(model.cfg, params, out, batch["targets"], z_loss, n_chunks)
  return ce_BT, state["intermediates"]


def summed_loss(model, train, n_devices, gather, params, microbatch):
  """(weighted sum of the token losses plus the MoE balancing losses, (weight sum, sparse-layer stats)) of the rows
  of `microbatch` this call sees: the whole (micro-)batch (n_devices 1, `gather` the identity), or one device's rows
  inside the per-device loop (parallel/microbatches.py). Terms that need the whole micro-batch (the balancing
  losses, means over its real tokens, and the stats) read the per-token taps all-gathered by `gather`; each device
  adds 1/n_devices of the balancing term, whose gradient the gather's transpose (a reduce-scatter of the taps) sums
  back to the devices' own tokens, so the step's mean loss carries it once."""
  loss_BT, intermediates = token_losses(model, params, microbatch, train.z_loss, train.get("loss_chunks", 0))
  weights_BT = microbatch["loss_weights"]
  taps = {  # the sparse layers' per-token taps [b, T, ...], what balance_loss and sparse_stats read
    layer: {"mlp": jax.tree.map(gather, values["mlp"])}
    for layer, values in intermediates.items()
    if layer.startswith("layers_") and "mlp" in values
  }
  all_weights_BT = gather(weights_BT)
  balance = moe.balance_loss(model.cfg, taps, all_weights_BT)
  total = (loss_BT * weights_BT).sum() + balance * all_weights_BT.sum() / n_devices
  return total, (weights_BT.sum(), sparse_stats(model.cfg, taps, all_weights_BT))
