"""FfnSpec: everything the stack knows about one feed-forward type, in one place.

Each layer file ends with its `SPEC`; `registry.SPECS` maps config.model.ffn.type to it. Code that used
to switch on the type's name (config checks, expert-parallel layouts, usage statistics, parameter and
FLOP accounting, circuits, sizing, export) reads the spec instead, so a new type is one layer file with
its SPEC, its PyTorch mirror class and one registry line (docs/adding_a_ffn_type.md).

Functions take `model` (config.model) and `ffn` (that layer's feed-forward sub-config: config.model.ffn,
or config.model.dense_ffn for a mixed model's dense blocks).
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Units:
  """How a sparse layer's table is split over the expert axis (sparsetx/parallel/expert_groups.py)."""

  name: str  # logical axis name of the units: "channel", "tree", "expert"
  field: str  # config.model.ffn field counting them: "n_channels", "n_trees", "n_experts"
  table_axes: tuple  # logical axes of the table that holds the units (its unit axis is `name`)

  def counts(self, ffn, counts_U) -> np.ndarray:
    """Each unit's picks from a layer's usage counts (Circuit.usage_units of them), which are unit-major: a channel's
    neurons, a tree's nodes, one expert each. `ffn`: a ConfigDict, or config.json's dict."""
    return np.asarray(counts_U, np.float64).reshape(ffn[self.field], -1).sum(1)


@dataclasses.dataclass(frozen=True)
class Circuit:
  """A token's sparse circuit as the layer taps it (sparsetx/interp/circuits.py, sparsetx/train/tracking/sparse_stats.py).

  The layer sows `units` (unit ids, [..., G, K] per group G when `block` is set, else [..., K]) and
  `weights` (same shape). Flat circuit ids offset group g by g * block(ffn), so they index a space of
  `size(ffn)` units.
  """

  units: str  # tap (and standard name) of the unit ids: "gate_indices", "path_nodes", "expert_ids"
  weights: str  # tap of their weights: "gate_scores", "node_logits", "expert_weights"
  size: Callable  # ffn -> number of units of the flat circuit space
  block: Callable | None  # ffn -> units per group (the ids' axis -2); None: ids are flat already
  weighted: bool = True  # the circuit's weights are the `weights` tap; False: every picked unit weighs 1
  usage_size: Callable | None = None  # ffn -> units of the usage space (ids modulo it: a table shared by groups)
  patchable: bool = True  # the circuit can be clamped (do(g = g_patch), interp/nie.py); False: routing is the forward
  tree_paths: bool = False  # units are heap-ordered nodes of binary trees visited along paths (FFF analyses)

  def ids(self, ffn, units, xp=np):
    """[..., S] flat circuit ids from the traced unit ids (numpy or jax.numpy arrays, `xp`)."""
    if self.block is None:
      return units
    groups = units.shape[-2]
    offsets = self.block(ffn) * xp.arange(groups).reshape((1,) * (units.ndim - 2) + (groups, 1))  # full rank
    ids = units + offsets.astype(units.dtype)
    return ids.reshape(units.shape[:-2] + (-1,))

  def usage_ids(self, ffn, ids):
    """Flat circuit ids in the usage space: modulo the shared table's size where the groups share one."""
    return ids if self.usage_size is None else ids % self.usage_size(ffn)

  def usage_units(self, ffn) -> int:
    """Size of the usage space: the circuit space, or the shared table's (ids taken modulo it)."""
    return (self.usage_size or self.size)(ffn)


@dataclasses.dataclass(frozen=True)
class FfnSpec:
  """One feed-forward type. Fields marked "sparse" are None for dense types."""

  name: str  # config.model.ffn.type
  module: type  # the flax module: module(config.model, name=...) maps [B, T, D] -> [B, T, D]
  fields: tuple  # the config.model.ffn fields the type reads (beyond `type`)
  check: Callable  # (ffn, d_model, prefix) -> None, raising ConfigError; from sparsetx.config.ffn_checks.FFN_CHECKS
  params: Callable  # (model, ffn) -> (total, active per token) parameters of one layer
  flops: Callable  # (model, ffn) -> forward FLOPs per token of one layer (2 per multiply-accumulate)
  ladder_size: Callable  # d_model -> {field: value} sizing the type by the ladder's rules (models/ladder.py)
  served_names: tuple  # the layers[i].mlp.* standard names the type serves (sparsetx/interp/names.py)
  torch_class: str  # the class mirroring the layer in sparsetx/hf/modeling/modeling_sparsetx.py
  cost: Callable  # (bld, model, ffn, n, E, G, b, devices) -> None: one step's phases and collectives (perf.cost)
  residual_bytes: Callable  # (model, ffn, tokens, itemsize) -> bytes one layer keeps for its backward (remat none)
  units: Units | None = None  # sparse: the units split over the expert axis
  neuron_table: tuple | None = None  # logical axes of a neuron table whose d_model may be split (sgatlin, PEER)
  circuit: Circuit | None = None  # sparse: how to read a token's circuit from the taps
  usage_stats: Callable | None = None  # (ffn, counts_U, taps, token_weights_BT) -> stats beyond used and gini
  # (ffn, counts_U) -> {statistic: value} of a training usage window beyond the common ones (train/tracking/usage_window.py)
  window_stats: Callable | None = None
  count_rows: Callable | None = None  # (ffn, counts_U) -> [rows, columns] of counts sparsetx-usage draws
  # (ffn, counts_U) -> a step's loads in the shape of the layer's selection bias (selection_bias.py), last axis the
  # units balanced against each other; None: the type has no bias_update_rate
  bias_loads: Callable | None = None
  # (ffn, tokens) -> bytes of the layer's routing decisions remat=save_routing keeps (scopes.ROUTING); None: nothing
  # saved by name (dense layers, FFF's walk)
  routing_bytes: Callable | None = None

  @property
  def sparse(self) -> bool:
    return self.circuit is not None


def subkey_counts(ffn, counts_U) -> tuple[np.ndarray, np.ndarray]:
  """Picks per sub-key of each half, per channel, of product-key neuron counts (sgatlin, PEER): neuron
  i*n_keys + j is sub-key i of the first half and j of the second. `ffn`: a ConfigDict, or config.json's dict."""
  n_keys = math.isqrt(ffn["d_ffw"])
  grid_CIJ = np.asarray(counts_U).reshape(-1, n_keys, n_keys)
  return grid_CIJ.sum(2), grid_CIJ.sum(1)


def product_key_routing_bytes(ffn, tokens: int) -> int:
  """sgatlin's and PEER's routing as save_routing keeps it: the top-k's picks twice (the router's and the tapped ones,
  int32) and the gates (float32), per token, channel and slot."""
  return tokens * ffn.n_channels * ffn.top_k * 3 * 4


def subkey_window_stats(ffn, counts_U) -> dict:
  """A dead sub-key silences a whole row of the product grid (Lample et al. 2019): the dead share of each half."""
  half1_CI, half2_CJ = subkey_counts(ffn, counts_U)
  return dict(dead_subkeys_half1=float((half1_CI == 0).mean()), dead_subkeys_half2=float((half2_CJ == 0).mean()))


def subkey_rows(ffn, counts_U) -> np.ndarray:
  """Both halves' sub-key counts side by side, one row per channel."""
  return np.concatenate(subkey_counts(ffn, counts_U), axis=1)


def dense_width(d_model: int) -> int:
  """The ladder's MLP/SwiGLU width, 8/3 d_model rounded down to a multiple of 256 (Listing 2); below d_model
  96, where that is 0, rounded down to a multiple of d_model (2 d_model)."""
  return int(8 / 3 * d_model / 256) * 256 or int(8 / 3 * d_model / d_model) * d_model


def product_key_width(base: int, step: int, d_model: int) -> int:
  """(base + step * scale)**2 neurons at scale = d_model / 128, the side rounded: a square for product keys."""
  return round(base + step * d_model / 128) ** 2


def product_key_params(model, ffn, peer_router: bool, table_rows: int) -> tuple[int, int]:
  """(total, active) parameters of a product-key layer: its router and its [2, table_rows, D] table."""
  D, C, n_keys = model.d_model, ffn.n_channels, math.isqrt(ffn.d_ffw)
  if peer_router:  # a query per channel, split in halves of d_key / 2
    router = C * D * ffn.d_key + C * n_keys * ffn.d_key
  else:  # one shared query, 2 key halves per channel
    router = D * ffn.d_key + ffn.d_key * 2 * C * n_keys
  if ffn.get("bias_update_rate", 0.0):  # the sub-keys' selection bias: per channel's table, or the shared table's
    router += 2 * n_keys * (C if table_rows == C * ffn.d_ffw else 1)
  return router + 2 * table_rows * D, router + C * ffn.top_k * 2 * D


def product_key_flops(model, ffn, peer_router: bool) -> int:
  """Forward FLOPs per token of a product-key layer: router scores plus C * k picked rows in and out."""
  D, C, n_keys = model.d_model, ffn.n_channels, math.isqrt(ffn.d_ffw)
  router = C * ffn.d_key * (D + n_keys) if peer_router else ffn.d_key * (D + 2 * C * n_keys)
  return 2 * (router + C * ffn.top_k * 2 * D)
