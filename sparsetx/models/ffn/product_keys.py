"""Product-key top-k (Lample et al. 2019) and the two routers built on it.

A neuron index is `i1 * n_keys + i2` and its score `s1[i1] + s2[i2]`. The exact top-k of all
`n_keys**2` sums lies inside the k x k sums of the two halves' own top-k, so k**2 candidates
suffice instead of d_ffw. Router scores and both top-k stages stay float32: bf16 creates ties.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from sparsetx.config import ConfigError, n_keys_for
from sparsetx.models.ffn.common import router_init
from sparsetx.parallel.expert_parallel import where_tokens_are


def product_key_top_k(scores1_N: jax.Array, scores2_N: jax.Array, k: int):
  """Top-k over {s1[i] + s2[j]} for the last axis of two score arrays of size n_keys.

  Returns (values [..., k] descending, indices [..., k] into the n_keys**2 product set).
  """
  n_keys = scores1_N.shape[-1]
  if scores2_N.shape[-1] != n_keys:
    raise ConfigError(f"product-key halves differ in size ({n_keys} vs {scores2_N.shape[-1]}); both must be n_keys.")
  if not 0 < k < n_keys:
    raise ConfigError(f"top_k={k} must lie in [1, sqrt(d_ffw)={n_keys}); lower top_k or raise d_ffw.")
  s1, i1 = jax.lax.top_k(scores1_N.astype(jnp.float32), k)
  s2, i2 = jax.lax.top_k(scores2_N.astype(jnp.float32), k)
  sums_KK = s1[..., :, None] + s2[..., None, :]
  ids_KK = i1[..., :, None] * n_keys + i2[..., None, :]
  flat_shape = sums_KK.shape[:-2] + (k * k,)
  values, best = jax.lax.top_k(sums_KK.reshape(flat_shape), k)
  indices = jnp.take_along_axis(ids_KK.reshape(flat_shape), best, axis=-1)
  return values, indices


class ProductKeyRouter(nn.Module):
  """sgatlin's gating network: one query shared by the channels, per-channel keys.

  q = W_query z (d_key); per channel c, scores = W_key_c q (2 * n_keys) split into halves.
  """

  d_ffw: int
  n_channels: int
  top_k: int
  d_key: int
  param_dtype: jnp.dtype = jnp.float32

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
    top_k = lambda s1, s2: product_key_top_k(s1, s2, self.top_k)  # noqa: E731
    return where_tokens_are(top_k, scores_BT2CN[:, :, 0], scores_BT2CN[:, :, 1])


class PeerRouter(nn.Module):
  """PEER's router: a query per channel, split in two halves scored against two sub-key sets."""

  d_ffw: int
  n_channels: int
  top_k: int
  d_key: int
  param_dtype: jnp.dtype = jnp.float32

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
    scores_BTC2N = jnp.einsum(
        "btcsh,csnh->btcsn", query_BTC2H, sub_keys_C2NH.astype(jnp.float32), precision="highest"
    )
    top_k = lambda s1, s2: product_key_top_k(s1, s2, self.top_k)  # noqa: E731
    return where_tokens_are(top_k, scores_BTC2N[..., 0, :], scores_BTC2N[..., 1, :])


def make_router(kind: str, cfg, param_dtype) -> nn.Module:
  router = {"product": ProductKeyRouter, "peer": PeerRouter}[kind]
  return router(
      d_ffw=cfg.d_ffw,
      n_channels=cfg.n_channels,
      top_k=cfg.top_k,
      d_key=cfg.d_key,
      param_dtype=param_dtype,
      name="router",
  )
