"""The config schema: every knob with its default, and validation with one clear error per mistake.

Configs are `ml_collections.ConfigDict`s; the files under `configs/` start from `default_config()`
and override fields. `validate()` is called before anything is built, so a bad value is reported
by its dotted name (``config.model.ffn.top_k``) with the fix, instead of failing deep inside jit.
"""

import math

import ml_collections

FFN_TYPES = ("mlp", "swiglu", "moe", "peer", "sgatlin", "fff")
BLOCK_KINDS = ("sequential", "parallel")
NORM_KINDS = ("rmsnorm", "layernorm")
SGATLIN_ACTIVATIONS = ("identity", "relu", "gelu", "swish")
SGATLIN_ROUTERS = ("product", "peer")
FFF_VARIANTS = ("fff", "fff_post")
FFF_IMPLEMENTATIONS = ("sparse", "masked_dense")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A config value is wrong; the message names the field and how to fix it."""


def ffn_defaults() -> ml_collections.ConfigDict:
  """Feed-forward knobs; each layer type reads the ones it needs (paper defaults)."""
  return ml_collections.ConfigDict(
      dict(
          type="sgatlin",
          d_ffw=28**2,  # neurons (sgatlin, peer: a square), hidden width (mlp, swiglu, moe expert)
          # sgatlin / peer
          n_channels=16,
          top_k=8,
          d_key=128,
          activation="identity",  # sgatlin ablation: relu | gelu | swish on <w_in, z>
          router="product",  # sgatlin: product (shared query) | peer (per-channel query, softmax)
          # moe (GPT-OSS style)
          n_experts=16,
          experts_per_token=2,
          # fff
          depth=6,
          n_trees=4,
          variant="fff",
          implementation="sparse",
      )
  )


def model_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
      dict(
          vocab_size=512,
          d_model=256,
          n_layers=4,
          head_dim=64,
          max_len=256,  # context window; also the T of the ladder's attention FLOPs
          block="sequential",  # sequential pre-norm | parallel (GPT-NeoX / Pythia)
          norm="rmsnorm",
          norm_eps=1e-6,
          use_bias=False,  # biases on attention and dense feed-forward projections (Pythia: True)
          rotary_fraction=1.0,
          rope_base=10_000.0,
          tie_embeddings=False,
          init_std=0.02,  # embeddings and dense projections
          dtype="bfloat16",  # compute; softmax and logits are always float32
          param_dtype="float32",
          remat=False,
          ffn=ffn_defaults(),
      )
  )


def default_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = model_defaults()
  return config


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _one_of(name: str, value, choices) -> None:
  _require(value in choices, f"{name}={value!r} is unknown; use one of {', '.join(map(repr, choices))}.")


def _positive_int(name: str, value) -> None:
  _require(isinstance(value, int) and value > 0, f"{name}={value!r} must be a positive integer.")


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
  if kind in ("peer", "sgatlin"):
    n_keys = n_keys_for(ffn.d_ffw, f"{prefix}.d_ffw")
    _positive_int(f"{prefix}.n_channels", ffn.n_channels)
    _positive_int(f"{prefix}.top_k", ffn.top_k)
    _positive_int(f"{prefix}.d_key", ffn.d_key)
    _require(
        ffn.top_k < n_keys,
        f"{prefix}.top_k={ffn.top_k} must be smaller than sqrt(d_ffw)={n_keys}; "
        "lower top_k or raise d_ffw.",
    )
    uses_peer_router = kind == "peer" or ffn.router == "peer"
    _require(
        not uses_peer_router or ffn.d_key % 2 == 0,
        f"{prefix}.d_key={ffn.d_key} must be even for the PEER router (the query is split in two halves).",
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


def validate_model(model: ml_collections.ConfigDict, prefix: str = "config.model") -> None:
  for field in ("vocab_size", "d_model", "n_layers", "head_dim", "max_len"):
    _positive_int(f"{prefix}.{field}", model[field])
  _require(
      model.d_model % model.head_dim == 0,
      f"{prefix}.d_model={model.d_model} is not divisible by {prefix}.head_dim={model.head_dim}; "
      "choose d_model as a multiple of head_dim.",
  )
  _one_of(f"{prefix}.block", model.block, BLOCK_KINDS)
  _one_of(f"{prefix}.norm", model.norm, NORM_KINDS)
  _one_of(f"{prefix}.dtype", model.dtype, DTYPES)
  _one_of(f"{prefix}.param_dtype", model.param_dtype, DTYPES)
  _require(
      0.0 <= model.rotary_fraction <= 1.0,
      f"{prefix}.rotary_fraction={model.rotary_fraction} must lie in [0, 1].",
  )
  rotary_dims = int(model.head_dim * model.rotary_fraction)
  _require(
      rotary_dims % 2 == 0,
      f"{prefix}.rotary_fraction={model.rotary_fraction} gives {rotary_dims} rotary dims of "
      f"head_dim={model.head_dim}; rotary dims must be even.",
  )
  validate_ffn(model.ffn, model.d_model, f"{prefix}.ffn")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks the whole config; returns it unchanged so callers can chain."""
  validate_model(config.model)
  return config
