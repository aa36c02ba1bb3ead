"""trace and patch: run a model by its standard names, reading values or replacing them (do-interventions).

`StandardizedTransformer(model_cfg, params)` wraps the flax `Transformer`. One jitted forward
(`_forward`) takes the patches as a `patches` variable collection (plus optional boolean
`patch_masks` that restrict a patch to chosen positions, see sparsetx/models/taps.py) and returns the
requested names; jit caches one program per set of read names and patch structure, so a sweep
over layers and positions with the same structure compiles once.

More: docs/modules.md, sparsetx/interp/trace.py.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sparsetx import config as config_lib
from sparsetx.interp import names as names_lib
from sparsetx.models.transformer import Transformer, make_norm, with_xla_attention


@dataclasses.dataclass(frozen=True, eq=False)
class FromRun:
  """The value a name takes when the model runs on another input (same shape), e.g. a counterfactual."""

  tokens_BT: Any
  positions_BT: Any = None
  segment_ids_BT: Any = None


@dataclasses.dataclass(frozen=True)
class Patch:
  """Replace a named value by `value` (array | function of the value | FromRun).

  `positions` restricts the replacement: None (everywhere), an int or sequence of ints (those
  sequence positions in every row), or a boolean [batch, seq] array. Elsewhere the value is what
  the patched forward pass computes.
  """

  value: Any
  positions: Any = None


def _as_patch(spec) -> Patch:
  return spec if isinstance(spec, Patch) else Patch(spec)


def _nested_set(tree: dict, path: tuple, leaf) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = leaf


def _nested_get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def position_mask(resolved: names_lib.Resolved, positions, batch: int, seq: int, ndim: int) -> np.ndarray:
  """A boolean mask that broadcasts against the value: True at the chosen (row, position) pairs."""
  axis = resolved.entry.seq_axis
  if axis is None:
    raise ValueError(f"{resolved.full_name} has no sequence axis; patch it whole (positions=None).")
  positions = np.asarray(positions)
  if positions.dtype == bool:
    mask_BT = np.broadcast_to(positions, (batch, seq))
  else:
    mask_BT = np.zeros((batch, seq), bool)
    mask_BT[:, positions.reshape(-1)] = True
  shape = [1] * ndim
  shape[0], shape[axis] = batch, seq
  return mask_BT.reshape(shape)


class StandardizedTransformer:
  """A Transformer and its params, addressed by standard names (see sparsetx/interp/names.py)."""

  def __init__(self, model_cfg, params):
    self.cfg = ml_collections.FrozenConfigDict(model_cfg)
    self.model = Transformer(with_xla_attention(self.cfg))  # the XLA attention: the only one with a pattern to read
    self.params = params
    self._forward = jax.jit(self._forward_impl, static_argnames=("reads",))

  @property
  def names(self) -> list[str]:
    return names_lib.served_names(self.cfg)

  def resolve(self, name: str) -> names_lib.Resolved:
    return names_lib.resolve(name, self.cfg)

  # The one compiled forward pass.
  def _forward_impl(self, params, tokens_BT, positions_BT, segment_ids_BT, patches, masks, *, reads: tuple):
    variables = {"params": params, "patches": patches, "patch_masks": masks}
    logits_BTV, state = self.model.apply(variables, tokens_BT, positions_BT, segment_ids_BT, mutable=["intermediates"])
    intermediates = state["intermediates"]
    out = {}
    for name in reads:
      resolved = self.resolve(name)
      entry = resolved.entry
      if not entry.derived:
        out[name] = _nested_get(intermediates, resolved.module_path + (resolved.tap_name,))[0]
      elif entry.name == "lm_head_output":
        out[name] = logits_BTV
      elif entry.name == "next_token_probs":
        out[name] = jax.nn.softmax(logits_BTV[:, -1].astype(jnp.float32), axis=-1)
      elif entry.name == "gate_vector":
        mlp = _nested_get(intermediates, (f"layers_{resolved.layer}", "mlp"))
        d_ffw = config_lib.layer_ffn_config(self.cfg, resolved.layer).d_ffw
        out[name] = gate_vector(mlp["gate_indices"][0], mlp["gate_scores"][0], d_ffw)
      else:  # every derived registry entry has a rule above; reaching here is a bug in this file
        raise AssertionError(f"no rule derives {entry.name!r}")
    return out

  def run(
    self, tokens_BT, names=("logits",), patches: dict | None = None, positions_BT=None, segment_ids_BT=None
  ) -> dict:
    """The requested named values of one forward pass with `patches` applied ({name: spec})."""
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    reads = tuple(dict.fromkeys(names))
    for name in reads:
      self.resolve(name)
    call = functools.partial(
      self._forward, self.params, tokens_BT, jnp.asarray(positions_BT), jnp.asarray(segment_ids_BT)
    )
    tree, masks = self._patch_trees(call, patches or {}, B, T)
    return call(tree, masks, reads=reads)

  def eval_shapes(self, batch: int, seq: int, names=None) -> dict:
    """{name: ShapeDtypeStruct} of every served name (or `names`) for a [batch, seq] input, without
    compiling or running anything (jax.eval_shape); params may be abstract too."""
    reads = tuple(self.names if names is None else names)
    tokens_BT = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return jax.eval_shape(
      functools.partial(self._forward_impl, reads=reads), self.params, tokens_BT, tokens_BT, tokens_BT, {}, {}
    )

  def trace(self, tokens_BT, names, **kwargs) -> dict:
    """Reads `names` (a name or a list) without changing anything."""
    names = [names] if isinstance(names, str) else list(names)
    return self.run(tokens_BT, names, **kwargs)

  def patch(self, tokens_BT, patches: dict, names=("logits",), **kwargs) -> dict:
    """Runs with `patches` ({name: array | function | FromRun | Patch}) and reads `names`."""
    names = [names] if isinstance(names, str) else list(names)
    return self.run(tokens_BT, names, patches=patches, **kwargs)

  def _patch_trees(self, call: Callable, patches: dict, B: int, T: int):
    """Turns {name: spec} into the `patches` and `patch_masks` collections, in forward order."""
    specs = sorted(((self.resolve(name), _as_patch(spec)) for name, spec in patches.items()), key=lambda p: p[0].order)
    for resolved, _ in specs:
      if not resolved.entry.patchable:
        raise ValueError(
          f"{resolved.full_name} is read-only ({resolved.entry.meaning}); patch a value it is derived from "
          "(gate_vector: gate_indices and gate_scores)."
        )
    other_runs = {}
    for resolved, spec in specs:  # values taken from other inputs: one run per distinct input
      if isinstance(spec.value, FromRun):
        other_runs.setdefault(id(spec.value), (spec.value, []))[1].append(resolved.full_name)
    taken = {}
    for source, wanted in other_runs.values():
      taken[id(source)] = self.run(source.tokens_BT, wanted, None, source.positions_BT, source.segment_ids_BT)
    tree, masks = {}, {}
    for resolved, spec in specs:
      value = spec.value
      if isinstance(value, FromRun):
        value = taken[id(value)][resolved.full_name]
      elif callable(value):  # the value under every patch so far (upstream ones decide it)
        value = value(call(tree, masks, reads=(resolved.full_name,))[resolved.full_name])
      path = resolved.module_path + (resolved.tap_name,)
      _nested_set(tree, path, jnp.asarray(value))
      if spec.positions is not None:
        _nested_set(masks, path, jnp.asarray(position_mask(resolved, spec.positions, B, T, jnp.ndim(value))))
    return tree, masks

  def project_on_vocab(self, x_BTD):
    """Logit lens: the final norm and the head applied to any residual-stream value [B,T,D]."""
    return _project(self.cfg, self.params, jnp.asarray(x_BTD))

  def __str__(self) -> str:
    from sparsetx.interp.printout import describe

    return describe(self.cfg, self.params)


@functools.partial(jax.jit, static_argnums=0)
def _project(cfg, params, x_BTD):
  """The model's own final norm and head (same modules and dtypes), so the last layer's lens is logits."""
  x_BTD = make_norm(cfg, "final_norm").apply({"params": params["final_norm"]}, x_BTD)
  if cfg.tie_embeddings:
    return jnp.einsum("btd,vd->btv", x_BTD.astype(jnp.float32), params["embed"]["embedding"].astype(jnp.float32))
  head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float32, param_dtype=jnp.dtype(cfg.param_dtype))
  return head.apply({"params": params["lm_head"]}, x_BTD.astype(jnp.float32))


def gate_vector(idx_BTCK, gates_BTCK, d_ffw: int):
  """[B,T,C,d_ffw]: the gates scattered at their neuron indices (indices within a channel are distinct)."""
  zeros = jnp.zeros(idx_BTCK.shape[:-1] + (d_ffw,), gates_BTCK.dtype)
  return jnp.put_along_axis(zeros, idx_BTCK, gates_BTCK, axis=-1, inplace=False)
