"""The per-type checks of a feed-forward sub-config (config.model.ffn, config.model.dense_ffn).

Kept apart from the cross-field checks because they belong to the feed-forward types: each type's
fields and allowed values are checked by its own function here (`FFN_CHECKS`), which the type's FfnSpec
(sparsetx/models/ffn/spec.py) names; config imports nothing above it, so the functions live here.
"""

import math
import re

import ml_collections

from sparsetx.config.errors import one_of as _one_of
from sparsetx.config.errors import positive_int as _positive_int
from sparsetx.config.errors import require as _require
from sparsetx.config.schema import TABLE_PLACEMENTS

SGATLIN_ACTIVATIONS = ("identity", "relu", "gelu", "swish")
SGATLIN_ROUTERS = ("product", "peer")
FFF_VARIANTS = ("fff", "fff_post")
MOE_ROUTER_SCORES = ("softmax", "sigmoid")
FFF_IMPLEMENTATIONS = ("sparse", "masked_dense")
# config.model.ffn.kernel.implementation: auto | reference | a registry name | an ordered list "a,b" of names; the
# names are the registry's (kernels/registry.py checks them when a step is set up: config imports nothing above it)
KERNEL_CHOICES = ("auto", "reference")
_NAME = re.compile(r"^[a-z][a-z0-9_]*(@[a-z_]+=\d+(,[a-z_]+=\d+)*)?$")


def n_keys_for(d_ffw: int, field: str = "config.model.ffn.d_ffw") -> int:
  """sqrt(d_ffw) for a product-key layer, refusing a d_ffw that is not a perfect square."""
  n_keys = math.isqrt(d_ffw) if isinstance(d_ffw, int) and d_ffw > 0 else 0
  _require(
    n_keys * n_keys == d_ffw and n_keys > 0,
    f"{field}={d_ffw!r} must be a perfect square (product keys index n_keys**2 neurons); "
    f"use e.g. {max(1, round(math.sqrt(max(d_ffw, 1)))) ** 2}.",
  )
  return n_keys


def _check_dense_width(ffn, prefix: str) -> None:
  _positive_int(f"{prefix}.d_ffw", ffn.d_ffw)


def _check_gelu_choice(ffn, prefix: str) -> None:
  choice = ffn.get("gelu_approximate", None)
  _require(
    choice is None or isinstance(choice, bool),
    f"{prefix}.gelu_approximate={choice!r} must be None (the layer's official form), True (tanh) or False (exact erf).",
  )


def _check_product_keys(ffn, prefix: str, peer_router: bool) -> None:
  n_keys = n_keys_for(ffn.d_ffw, f"{prefix}.d_ffw")
  _positive_int(f"{prefix}.n_channels", ffn.n_channels)
  _positive_int(f"{prefix}.top_k", ffn.top_k)
  _positive_int(f"{prefix}.d_key", ffn.d_key)
  _require(
    ffn.top_k < n_keys,
    f"{prefix}.top_k={ffn.top_k} must be smaller than sqrt(d_ffw)={n_keys}; lower top_k or raise d_ffw.",
  )
  _require(
    not peer_router or ffn.d_key % 2 == 0,
    f"{prefix}.d_key={ffn.d_key} must be even for the PEER router (the query is split in two halves).",
  )
  _check_gelu_choice(ffn, prefix)


def implementation_for_retired(implementation: str, gpu_kernel: str | None = "auto") -> str:
  """The one knob's value for a config written with the retired family value and kernel.gpu_kernel: XLA and the
  reference stay; a GPU kernel named by gpu_kernel goes first with the TPU's after it (as the two knobs chose);
  `pallas` was the kernels in the default order."""
  if implementation in ("xla", "reference"):
    return implementation
  if gpu_kernel not in (None, "auto"):
    return f"{gpu_kernel},tpu"
  return "triton,mosaic,tpu" if implementation == "pallas" else implementation


def implementation_names(implementation: str) -> list:
  """The registry names an implementation value lists (one, or an ordered list)."""
  return [name.strip() for name in implementation.split(",")] if "@" not in implementation else [implementation]


def _check_kernel(ffn, prefix: str) -> None:
  kernel = ffn.kernel
  if "gpu_kernel" in kernel or kernel.implementation == "pallas":
    new = implementation_for_retired(kernel.implementation, kernel.get("gpu_kernel"))
    _require(
      False,
      f"{prefix}.kernel.gpu_kernel and implementation='pallas' are retired: one knob names the implementation on "
      f"every platform; set {prefix}.kernel.implementation={new!r} (and drop gpu_kernel).",
    )
  implementation = kernel.implementation
  _require(
    isinstance(implementation, str)
    and (implementation in KERNEL_CHOICES or all(_NAME.match(n) for n in implementation_names(implementation))),
    f"{prefix}.kernel.implementation={implementation!r} must be auto, reference, an implementation's name (e.g. "
    f"triton, mosaic, tpu, xla) or an ordered list of names ('triton,tpu'); kernels/registry.py lists them.",
  )
  for field in ("token_chunk", "pair_chunk", "block_tokens", "block_d", "stages"):
    _positive_int(f"{prefix}.kernel.{field}", kernel[field])
  chunk = ffn.kernel.get("segment_chunk", 64)
  _require(
    isinstance(chunk, int) and chunk >= 0,
    f"{prefix}.kernel.segment_chunk={chunk!r} must be a whole number of pairs >= 0 (0 keeps every row whole).",
  )
  rows = ffn.kernel.get("group_rows", 128)
  _require(
    isinstance(rows, int) and rows >= 16 and rows & (rows - 1) == 0,
    f"{prefix}.kernel.group_rows={rows!r} must be a power of two >= 16 (a grouped-matmul tile); 128 is the default.",
  )


def check_mlp(ffn: ml_collections.ConfigDict, d_model: int, prefix: str) -> None:
  """mlp: d_ffw neurons."""
  _check_dense_width(ffn, prefix)


def check_swiglu(ffn: ml_collections.ConfigDict, d_model: int, prefix: str) -> None:
  """swiglu: d_ffw gated neurons."""
  _check_dense_width(ffn, prefix)


def check_moe(ffn: ml_collections.ConfigDict, d_model: int, prefix: str) -> None:
  """moe: n_experts experts of d_ffw neurons, experts_per_token of them per token, two balancing losses."""
  _check_dense_width(ffn, prefix)
  _positive_int(f"{prefix}.n_experts", ffn.n_experts)
  _positive_int(f"{prefix}.experts_per_token", ffn.experts_per_token)
  _require(
    ffn.experts_per_token <= ffn.n_experts,
    f"{prefix}.experts_per_token={ffn.experts_per_token} exceeds {prefix}.n_experts={ffn.n_experts}; "
    "route each token to at most n_experts experts.",
  )
  _check_kernel(ffn, prefix)
  for field in ("aux_loss", "router_z_loss"):
    value = ffn.get(field, 0.0)
    _require(
      isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
      f"{prefix}.{field}={value!r} must be a finite number >= 0 (0 turns it off).",
    )
  _check_bias_update_rate(ffn, prefix)
  shared = ffn.get("n_shared_experts", 0)
  _require(
    isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0,
    f"{prefix}.n_shared_experts={shared!r} must be a whole number >= 0 (0: no shared experts).",
  )
  _one_of(f"{prefix}.router_scores", ffn.get("router_scores", "softmax"), MOE_ROUTER_SCORES)


def _check_bias_update_rate(ffn, prefix: str) -> None:
  value = ffn.get("bias_update_rate", 0.0)
  _require(
    isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
    f"{prefix}.bias_update_rate={value!r} must be a finite number >= 0 (0 turns loss-free balancing off; "
    "DeepSeek-V3 uses 0.001).",
  )


def check_peer(ffn: ml_collections.ConfigDict, d_model: int, prefix: str) -> None:
  """peer: one shared table of d_ffw (a square) neurons, n_channels heads of top_k, the PEER router."""
  _check_product_keys(ffn, prefix, peer_router=True)
  _check_kernel(ffn, prefix)
  _check_bias_update_rate(ffn, prefix)


def check_sgatlin(ffn: ml_collections.ConfigDict, d_model: int, prefix: str) -> None:
  """sgatlin: n_channels tables of d_ffw (a square) neurons, top_k per channel, its activation and router."""
  _check_product_keys(ffn, prefix, peer_router=ffn.router == "peer")
  _one_of(f"{prefix}.activation", ffn.activation, SGATLIN_ACTIVATIONS)
  _one_of(f"{prefix}.router", ffn.router, SGATLIN_ROUTERS)
  _check_kernel(ffn, prefix)
  _check_bias_update_rate(ffn, prefix)


def check_fff(ffn: ml_collections.ConfigDict, d_model: int, prefix: str) -> None:
  """fff: n_trees binary trees of the given depth, the variant and the implementation."""
  _check_gelu_choice(ffn, prefix)
  _require(
    isinstance(ffn.depth, int) and ffn.depth >= 0,
    f"{prefix}.depth={ffn.depth!r} must be an integer >= 0 (0 is a single node per tree).",
  )
  _positive_int(f"{prefix}.n_trees", ffn.n_trees)
  _one_of(f"{prefix}.variant", ffn.variant, FFF_VARIANTS)
  _one_of(f"{prefix}.implementation", ffn.implementation, FFF_IMPLEMENTATIONS)
  _check_kernel(ffn, prefix)


# The check of each type's fields; each type's FfnSpec (sparsetx/models/ffn) names the same function.
FFN_CHECKS = {
  "mlp": check_mlp,
  "swiglu": check_swiglu,
  "moe": check_moe,
  "peer": check_peer,
  "sgatlin": check_sgatlin,
  "fff": check_fff,
}
FFN_TYPES = tuple(FFN_CHECKS)


def validate_ffn(ffn: ml_collections.ConfigDict, d_model: int, prefix: str = "config.model.ffn") -> None:
  _one_of(f"{prefix}.type", ffn.type, FFN_TYPES)
  _one_of(f"{prefix}.placement", ffn.get("placement", "auto"), TABLE_PLACEMENTS)
  FFN_CHECKS[ffn.type](ffn, d_model, prefix)
