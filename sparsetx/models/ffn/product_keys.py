"""Product-key top-k (Lample et al. 2019) and the two routers built on it.

A neuron index is `i1 * n_keys + i2` and its score `s1[i1] + s2[i2]`. The exact top-k of all
`n_keys**2` sums lies inside the k x k sums of the two halves' own top-k, so k**2 candidates
suffice instead of d_ffw. Router scores and both top-k stages stay float32: bf16 creates ties.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sparsetx import scopes
from sparsetx.config import ConfigError, n_keys_for
from sparsetx.kernels import platform
from sparsetx.models.ffn import selection_bias
from sparsetx.models.ffn.common import router_init
from sparsetx.parallel.own_tokens import on_own_tokens_BT

_INT32_MIN = jnp.iinfo(jnp.int32).min
_INT32_MAX = jnp.iinfo(jnp.int32).max
CPU_ROWS_PER_CHUNK = 256  # two halves x n_keys x 256 rows of int32 stay in L2 during the k passes


def order_key(x):
  """float32 -> int32 whose signed order is the IEEE total order lax.top_k sorts by (NaN first, +0 > -0)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return bits ^ ((bits >> 31) & _INT32_MAX)


def from_order_key(key):
  return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & _INT32_MAX), jnp.float32)


def _top_k_passes(key, ids, k: int, axis: int):
  """Top-k along `axis` by k passes of max, ties to the lowest of the distinct `ids`: (keys, ids) stacked on `axis`.

  A taken entry's key drops to int32 min, below every real key (clamped one above it, which merges only the two
  largest-payload negative NaNs), so it is never picked again.
  """
  key = jnp.maximum(key, _INT32_MIN + 1)
  picked_keys, picked_ids = [], []
  for _ in range(k):
    best_key = key.max(axis, keepdims=True)
    best_id = jnp.where(key == best_key, ids, _INT32_MAX).min(axis, keepdims=True)
    key = jnp.where(ids == best_id, _INT32_MIN, key)
    picked_keys.append(best_key)
    picked_ids.append(best_id)
  return jnp.concatenate(picked_keys, axis), jnp.concatenate(picked_ids, axis)


def _candidate_pairs(k: int):
  """Ranks (i, j) in the halves' sorted top-k whose sum can be among the top k: (i + 1) * (j + 1) <= k.

  The sum at (i, j) is at most each of the (i + 1) * (j + 1) sums at (i' <= i, j' <= j), and on a tie those
  have the lower neuron index, so beyond k of them (i, j) cannot be picked (20 pairs instead of 64 for k=8).
  """
  pairs = [(i, j) for i in range(k) for j in range(k) if (i + 1) * (j + 1) <= k]
  return tuple(jnp.array(p, jnp.int32) for p in zip(*pairs))


def halves_top_k_passes(key_2NR, k: int):
  """Both halves' top-k by passes with rows on the minor axis (vectorized); [2, n_keys, R] -> [2, k, R] x 2."""
  ids_2NR = jax.lax.broadcasted_iota(jnp.int32, key_2NR.shape, 1)
  return _top_k_passes(key_2NR, ids_2NR, k, axis=1)


def _candidates(top1, top2, n_keys: int, k: int, axis: int):
  """The candidate pairs of the halves' top-k along `axis`: (their sums' order keys, their neuron ids)."""
  (key1, id1), (key2, id2) = top1, top2
  rank1, rank2 = _candidate_pairs(k)
  take = lambda a, r: jnp.take(a, r, axis=axis)  # noqa: E731
  sums = order_key(from_order_key(take(key1, rank1)) + from_order_key(take(key2, rank2)))
  return sums, take(id1, rank1) * n_keys + take(id2, rank2)


def _sums_top_k(top1, top2, n_keys: int, k: int, axis: int):
  """Stage two on the candidate pairs: (keys, neuron ids) of the top k sums; ties to the lower neuron index."""
  return _top_k_passes(*_candidates(top1, top2, n_keys, k, axis), k, axis)


def _neuron_ids_cpu(key1, key2, k: int, rows_per_chunk: int):
  """Both stages in chunks of rows that stay in cache, rows on the minor axis: [..., n_keys] x 2 -> [..., k]."""
  n_keys, batch = key1.shape[-1], key1.shape[:-1]
  key_2RN = jnp.stack([key1, key2]).reshape(2, -1, n_keys)
  rows = key_2RN.shape[1]
  chunk = max(1, min(rows_per_chunk, rows))
  n_chunks = -(-rows // chunk)
  key_2RN = jnp.pad(key_2RN, ((0, 0), (0, n_chunks * chunk - rows), (0, 0)))
  key_G2NC = key_2RN.reshape(2, n_chunks, chunk, n_keys).transpose(1, 0, 3, 2)

  def chunk_ids(key_2NC):
    keys_2KC, ids_2KC = halves_top_k_passes(key_2NC, k)
    return _sums_top_k((keys_2KC[0], ids_2KC[0]), (keys_2KC[1], ids_2KC[1]), n_keys, k, axis=0)[1]

  ids_GKC = jax.lax.map(chunk_ids, key_G2NC)
  return ids_GKC.transpose(0, 2, 1).reshape(n_chunks * chunk, k)[:rows].reshape(batch + (k,))


def _neuron_ids_top_k(key1, key2, k: int):
  """Stage one by lax.top_k (the accelerators' own kernel), stage two by one sort of the candidate pairs.

  The sort orders (key descending, neuron ascending), the order `_top_k_passes` picks in: neuron ids are distinct,
  so its first k are the passes' k. One kernel on a GPU, where the k passes compile to about 3 k launches, each
  reading every candidate."""
  sums, ids = _candidates(jax.lax.top_k(key1, k), jax.lax.top_k(key2, k), key1.shape[-1], k, axis=-1)
  neg_sums = -jnp.maximum(sums, _INT32_MIN + 1)  # the passes' clamp: int32 min has no negation
  _, ids = jax.lax.sort((neg_sums, ids), dimension=-1, num_keys=2)
  return ids[..., :k]


def product_key_top_k(scores1_N: jax.Array, scores2_N: jax.Array, k: int, cpu_rows_per_chunk: int = CPU_ROWS_PER_CHUNK):
  """Top-k over {s1[i] + s2[j]} for the last axis of two score arrays of size n_keys.

  Returns (values [..., k] descending, indices [..., k] into the n_keys**2 product set); values are those of
  the brute-force top-k over all sums, and so are the indices unless two sums tie only after rounding. Equal
  sums go to the lower neuron index. On CPU both stages run as k passes of max over cache-sized chunks of
  rows (faster than XLA's CPU TopK: docs/kernels.md), `cpu_rows_per_chunk` rows at a time; elsewhere stage one
  stays lax.top_k.
  """
  n_keys = scores1_N.shape[-1]
  if scores2_N.shape[-1] != n_keys:
    raise ConfigError(f"product-key halves differ in size ({n_keys} vs {scores2_N.shape[-1]}); both must be n_keys.")
  if not 0 < k < n_keys:
    raise ConfigError(f"top_k={k} must lie in [1, sqrt(d_ffw)={n_keys}); lower top_k or raise d_ffw.")
  s1, s2 = scores1_N.astype(jnp.float32), scores2_N.astype(jnp.float32)
  if platform.on_cpu():
    indices = _neuron_ids_cpu(order_key(s1), order_key(s2), k, cpu_rows_per_chunk)
  else:
    indices = _neuron_ids_top_k(order_key(s1), order_key(s2), k)  # integer keys: no gradient flows into the choice
  indices = checkpoint_name(indices, scopes.ROUTED_INDICES)  # what remat=save_routing keeps: no top-k in the backward
  values = jnp.take_along_axis(s1, indices // n_keys, axis=-1) + jnp.take_along_axis(s2, indices % n_keys, axis=-1)
  return values, indices


def pick_unbiased(k: int, scores1, scores2, choice1, choice2):
  """Product-key top-k chosen on `choice` (the scores plus the selection bias), valued by the unbiased `scores`:
  (s1[i1] + s2[i2] of the k picked, their indices)."""
  n_keys = scores1.shape[-1]
  _, indices = product_key_top_k(choice1, choice2, k)
  s1, s2 = scores1.astype(jnp.float32), scores2.astype(jnp.float32)
  values = jnp.take_along_axis(s1, indices // n_keys, axis=-1) + jnp.take_along_axis(s2, indices % n_keys, axis=-1)
  return values, indices


def routed(module, top_k: int, bias_shape, scores1, scores2):
  """on_own_tokens_BT of the product-key top-k on the halves [..., C, n_keys]; with `bias_shape` the layer's
  selection bias ([C, 2, n_keys], or [2, n_keys] shared by the channels) moves the choice, not the values."""
  if bias_shape is None:
    return on_own_tokens_BT(lambda s1, s2: product_key_top_k(s1, s2, top_k), scores1, scores2)
  bias_C2N = jnp.broadcast_to(
    jax.lax.stop_gradient(selection_bias.param(module, bias_shape)), scores1.shape[-2:-1] + (2, scores1.shape[-1])
  )
  lead = (None,) * (scores1.ndim - 2)
  choice1, choice2 = scores1 + bias_C2N[lead + (slice(None), 0)], scores2 + bias_C2N[lead + (slice(None), 1)]
  return on_own_tokens_BT(functools.partial(pick_unbiased, top_k), scores1, scores2, choice1, choice2)


class ProductKeyRouter(nn.Module):
  """sgatlin's gating network: one query shared by the channels, per-channel keys.

  q = W_query z (d_key); per channel c, scores = W_key_c q (2 * n_keys) split into halves.
  """

  d_ffw: int
  n_channels: int
  top_k: int
  d_key: int
  param_dtype: jnp.dtype = jnp.float32
  bias_shape: tuple | None = None  # the selection bias's (selection_bias.py); None: no balancing

  @nn.compact
  def __call__(self, x_BTD):
    n_keys = n_keys_for(self.d_ffw)
    query = nn.DenseGeneral(
      self.d_key,
      use_bias=False,
      dtype=jnp.float32,
      param_dtype=self.param_dtype,
      kernel_init=router_init(("embed", "key")),
      name="query",
    )(x_BTD.astype(jnp.float32))
    scores_BT2CN = nn.DenseGeneral(
      (2, self.n_channels, n_keys),
      use_bias=False,
      dtype=jnp.float32,
      param_dtype=self.param_dtype,
      kernel_init=router_init(("key", None, "channel", None)),
      name="keys",
    )(query)
    return routed(self, self.top_k, self.bias_shape, scores_BT2CN[:, :, 0], scores_BT2CN[:, :, 1])


class PeerRouter(nn.Module):
  """PEER's router: a query per channel, split in two halves scored against two sub-key sets."""

  d_ffw: int
  n_channels: int
  top_k: int
  d_key: int
  param_dtype: jnp.dtype = jnp.float32
  bias_shape: tuple | None = None  # the selection bias's (selection_bias.py); None: no balancing

  @nn.compact
  def __call__(self, x_BTD):
    n_keys = n_keys_for(self.d_ffw)
    half = self.d_key // 2
    query_BTC2H = nn.DenseGeneral(
      (self.n_channels, 2, half),
      use_bias=False,
      dtype=jnp.float32,
      param_dtype=self.param_dtype,
      kernel_init=router_init(("embed", "channel", None, "key")),
      name="query",
    )(x_BTD.astype(jnp.float32))
    sub_keys_C2NH = self.param(
      "sub_keys",
      nn.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2, batch_axis=(0, 1)),
        ("channel", None, None, "key"),
      ),
      (self.n_channels, 2, n_keys, half),
      self.param_dtype,
    )
    scores_BTC2N = jnp.einsum("btcsh,csnh->btcsn", query_BTC2H, sub_keys_C2NH.astype(jnp.float32), precision="highest")
    return routed(self, self.top_k, self.bias_shape, scores_BTC2N[..., 0, :], scores_BTC2N[..., 1, :])


def make_router(kind: str, cfg, param_dtype, bias_shape=None) -> nn.Module:
  """The router `kind`; `bias_shape` (with cfg.bias_update_rate > 0) its sub-keys' selection bias."""
  router = {"product": ProductKeyRouter, "peer": PeerRouter}[kind]
  return router(
    d_ffw=cfg.d_ffw,
    n_channels=cfg.n_channels,
    top_k=cfg.top_k,
    d_key=cfg.d_key,
    param_dtype=param_dtype,
    bias_shape=bias_shape if selection_bias.rate(cfg) else None,
    name="router",
  )


def subkey_loads(ffn, counts_U):
  """A step's picks per sub-key of each half, [channels, 2, n_keys], from product-key neuron counts (neuron
  i * n_keys + j: sub-key i of half 1, j of half 2); one channel row for a shared table (PEER)."""
  n_keys = n_keys_for(ffn.d_ffw)
  grid_CIJ = counts_U.reshape(-1, n_keys, n_keys)
  return jnp.stack([grid_CIJ.sum(2), grid_CIJ.sum(1)], axis=1)
