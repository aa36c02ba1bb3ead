"""The per-type checks of a feed-forward sub-config (config.model.ffn, config.model.dense_ffn).

Kept apart from the cross-field checks because they belong to the feed-forward types: each type's
fields and allowed values are listed here, and only here, until each type carries its own spec.
"""

import math

import ml_collections

from sparsetx.config.errors import one_of as _one_of
from sparsetx.config.errors import positive_int as _positive_int
from sparsetx.config.errors import require as _require

FFN_TYPES = ("mlp", "swiglu", "moe", "peer", "sgatlin", "fff")
SGATLIN_ACTIVATIONS = ("identity", "relu", "gelu", "swish")
SGATLIN_ROUTERS = ("product", "peer")
FFF_VARIANTS = ("fff", "fff_post")
FFF_IMPLEMENTATIONS = ("sparse", "masked_dense")
KERNEL_IMPLEMENTATIONS = ("xla", "pallas", "auto")  # gated gather: see sparsetx/kernels/gated_gather.py
GPU_KERNELS = ("mosaic", "triton", "auto")


def n_keys_for(d_ffw: int, field: str = "config.model.ffn.d_ffw") -> int:
  """sqrt(d_ffw) for a product-key layer, refusing a d_ffw that is not a perfect square."""
  n_keys = math.isqrt(d_ffw) if isinstance(d_ffw, int) and d_ffw > 0 else 0
  _require(
    n_keys * n_keys == d_ffw and n_keys > 0,
    f"{field}={d_ffw!r} must be a perfect square (product keys index n_keys**2 neurons); "
    f"use e.g. {max(1, round(math.sqrt(max(d_ffw, 1)))) ** 2}.",
  )
  return n_keys


def validate_ffn(ffn: ml_collections.ConfigDict, d_model: int, prefix: str = "config.model.ffn") -> None:
  _one_of(f"{prefix}.type", ffn.type, FFN_TYPES)
  kind = ffn.type
  if kind in ("mlp", "swiglu", "moe"):
    _positive_int(f"{prefix}.d_ffw", ffn.d_ffw)
  if kind == "moe":
    _positive_int(f"{prefix}.n_experts", ffn.n_experts)
    _positive_int(f"{prefix}.experts_per_token", ffn.experts_per_token)
    _require(
      ffn.experts_per_token <= ffn.n_experts,
      f"{prefix}.experts_per_token={ffn.experts_per_token} exceeds {prefix}.n_experts={ffn.n_experts}; "
      "route each token to at most n_experts experts.",
    )
    for field in ("aux_loss", "router_z_loss"):
      value = ffn.get(field, 0.0)
      _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
        f"{prefix}.{field}={value!r} must be a finite number >= 0 (0 turns it off).",
      )
  if kind in ("peer", "sgatlin"):
    n_keys = n_keys_for(ffn.d_ffw, f"{prefix}.d_ffw")
    _positive_int(f"{prefix}.n_channels", ffn.n_channels)
    _positive_int(f"{prefix}.top_k", ffn.top_k)
    _positive_int(f"{prefix}.d_key", ffn.d_key)
    _require(
      ffn.top_k < n_keys,
      f"{prefix}.top_k={ffn.top_k} must be smaller than sqrt(d_ffw)={n_keys}; lower top_k or raise d_ffw.",
    )
    uses_peer_router = kind == "peer" or ffn.router == "peer"
    _require(
      not uses_peer_router or ffn.d_key % 2 == 0,
      f"{prefix}.d_key={ffn.d_key} must be even for the PEER router (the query is split in two halves).",
    )
  if kind in ("peer", "sgatlin", "fff"):
    choice = ffn.get("gelu_approximate", None)
    _require(
      choice is None or isinstance(choice, bool),
      f"{prefix}.gelu_approximate={choice!r} must be None (the layer's official form), True (tanh) or "
      "False (exact erf).",
    )
  if kind == "sgatlin":
    _one_of(f"{prefix}.activation", ffn.activation, SGATLIN_ACTIVATIONS)
    _one_of(f"{prefix}.router", ffn.router, SGATLIN_ROUTERS)
  if kind == "fff":
    _require(
      isinstance(ffn.depth, int) and ffn.depth >= 0,
      f"{prefix}.depth={ffn.depth!r} must be an integer >= 0 (0 is a single node per tree).",
    )
    _positive_int(f"{prefix}.n_trees", ffn.n_trees)
    _one_of(f"{prefix}.variant", ffn.variant, FFF_VARIANTS)
    _one_of(f"{prefix}.implementation", ffn.implementation, FFF_IMPLEMENTATIONS)
  if kind in ("peer", "sgatlin", "fff"):
    _one_of(f"{prefix}.kernel.implementation", ffn.kernel.implementation, KERNEL_IMPLEMENTATIONS)
    for field in ("token_chunk", "pair_chunk", "block_tokens", "block_d", "stages"):
      _positive_int(f"{prefix}.kernel.{field}", ffn.kernel[field])
    _one_of(f"{prefix}.kernel.gpu_kernel", ffn.kernel.gpu_kernel, GPU_KERNELS)
