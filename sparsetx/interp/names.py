"""The standard names: one registry of every value a researcher reads or patches, with its layout.

The names are nnterp's (a GPT-NeoX model's interface), so a recipe written against nnterp reads the
same value here: `layers[i].layer_output`, `layers[i].self_attn.attention_output`, `logits`, ...
The feed-forward layers add their circuits: sgatlin/PEER gates, FFF tree paths, MoE expert ids.

More: docs/modules.md, sparsetx/interp/names.py.
"""

import dataclasses
import re

from sparsetx import config as config_lib
from sparsetx.models.ffn.registry import SPECS

ALL_FFN = None  # an entry served by every feed-forward type


@dataclasses.dataclass(frozen=True)
class StandardName:
  name: str
  scope: str  # "model" | "layer" | "self_attn" | "mlp"
  layout: str  # "Kind [axis axis ...]"
  meaning: str
  ffn_types: tuple | None = ALL_FFN
  tap: tuple | None = None  # (module path under the scope's module, tap name); None: derived
  patchable: bool = True
  seq_axis: int | None = 1  # the axis a position selects (query axis of a pattern); None: no positions

  @property
  def derived(self) -> bool:
    return self.tap is None

  @property
  def axes(self) -> tuple:
    return tuple(re.search(r"\[(.*)\]", self.layout).group(1).split())


RESIDUAL = "Residual [batch seq d_model]"


def serving(name: str) -> tuple:
  """The feed-forward types whose FfnSpec.served_names list the layers[i].mlp name `name`."""
  return tuple(spec.name for spec in SPECS.values() if name in spec.served_names)


REGISTRY = (
  StandardName(
    "token_embeddings",
    "model",
    RESIDUAL,
    "The embedding's output; layers[0].layer_input is what enters the first block",
    tap=((), "token_embeddings"),
  ),
  StandardName("layer_input", "layer", RESIDUAL, "The residual stream entering the block", tap=((), "layer_input")),
  StandardName(
    "attention_norm_output",
    "layer",
    RESIDUAL,
    "The normed stream entering the attention",
    tap=((), "attention_norm_output"),
  ),
  StandardName(
    "attention_probabilities",
    "self_attn",
    "Pattern [batch heads query key]",
    "The attention pattern the values are mixed with (softmax of the masked, scaled scores)",
    tap=(("attention",), "attention_probabilities"),
    seq_axis=2,
  ),
  StandardName(
    "attention_output",
    "self_attn",
    RESIDUAL,
    "What the attention adds to the residual stream (output projection included)",
    tap=((), "attention_output"),
  ),
  StandardName(
    "mlp_input",
    "layer",
    RESIDUAL,
    "What the feed-forward layer is called with: the norm of the stream (sequential: after the "
    "attention add; parallel: of the block input)",
    tap=((), "mlp_input"),
  ),
  StandardName(
    "mlp_neurons",
    "mlp",
    "Neurons [batch seq d_ffw]",
    "What the down projection receives: GELU(W_in x) (mlp), swish(gate)*up (swiglu)",
    ffn_types=serving("mlp_neurons"),
    tap=(("mlp",), "mlp_neurons"),
  ),
  StandardName(
    "gate_indices",
    "mlp",
    "GateIndices [batch seq channels top_k]",
    "Per channel, the k neurons the product-key router picked (index into the channel's d_ffw)",
    ffn_types=serving("gate_indices"),
    tap=(("mlp",), "gate_indices"),
  ),
  StandardName(
    "gate_scores",
    "mlp",
    "GateScores [batch seq channels top_k]",
    "The gates of those neurons: raw summed product-key scores (sgatlin), softmax over k (PEER)",
    ffn_types=serving("gate_scores"),
    tap=(("mlp",), "gate_scores"),
  ),
  StandardName(
    "gate_vector",
    "mlp",
    "GateVector [batch seq channels d_ffw]",
    "The token's circuit: gate_scores scattered at gate_indices, zero elsewhere (k nonzeros per "
    "channel); derived, read-only (patch gate_indices and gate_scores)",
    ffn_types=serving("gate_vector"),
    patchable=False,
  ),
  StandardName(
    "path_nodes",
    "mlp",
    "TreePath [batch seq trees path_length]",
    "The FFF circuit: per tree, the heap index of the node visited at each of the depth+1 levels; "
    "read-only (routing is the forward pass)",
    ffn_types=serving("path_nodes"),
    tap=(("mlp",), "path_nodes"),
    patchable=False,
  ),
  StandardName(
    "node_logits",
    "mlp",
    "NodeLogits [batch seq trees path_length]",
    "z = <x, w_in> + b_in of each visited node (its sign chose the next child); read-only",
    ffn_types=serving("node_logits"),
    tap=(("mlp",), "node_logits"),
    patchable=False,
  ),
  StandardName(
    "expert_ids",
    "mlp",
    "ExpertIds [batch seq experts_per_token]",
    "The experts the MoE router picked, best first",
    ffn_types=serving("expert_ids"),
    tap=(("mlp",), "expert_ids"),
  ),
  StandardName(
    "expert_weights",
    "mlp",
    "ExpertWeights [batch seq experts_per_token]",
    "Softmax over the picked experts' router logits: their mixing weights",
    ffn_types=serving("expert_weights"),
    tap=(("mlp",), "expert_weights"),
  ),
  StandardName(
    "mlp_output", "mlp", RESIDUAL, "What the feed-forward layer adds to the residual stream", tap=((), "mlp_output")
  ),
  StandardName(
    "layer_output",
    "layer",
    RESIDUAL,
    "The residual stream leaving the block: layer_input + attention_output + mlp_output",
    tap=((), "layer_output"),
  ),
  StandardName(
    "final_norm_output",
    "model",
    RESIDUAL,
    "The stream after the final norm, what the head reads",
    tap=((), "final_norm_output"),
  ),
  StandardName(
    "lm_head_output",
    "model",
    "Logits [batch seq vocab_size]",
    "The head's logits; sparsetx applies nothing past the head, so this equals logits; derived, read-only",
    patchable=False,
  ),
  StandardName(
    "logits", "model", "Logits [batch seq vocab_size]", "The logits the model returns (float32)", tap=((), "logits")
  ),
  StandardName(
    "next_token_probs",
    "model",
    "NextTokenProbs [batch vocab_size]",
    "softmax(logits) at the last position; derived, read-only",
    patchable=False,
    seq_axis=None,
  ),
)
BY_NAME = {entry.name: entry for entry in REGISTRY}
_FULL = re.compile(r"^(?:layers\[(\d+)\]\.(?:(self_attn|mlp)\.)?)?(\w+)$")


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A full name bound to one model: its entry, layer, module path and forward-order key."""

  full_name: str
  entry: StandardName
  layer: int | None

  @property
  def module_path(self) -> tuple:
    prefix = () if self.layer is None else (f"layers_{self.layer}",)
    return prefix + tuple(self.entry.tap[0])

  @property
  def tap_name(self) -> str:
    return self.entry.tap[1]

  @property
  def order(self) -> tuple:
    """Sorts names in the order the forward pass computes them (function patches need it)."""
    if self.layer is None:
      layer = -1 if self.entry.name == "token_embeddings" else 10**9
    else:
      layer = self.layer
    return (layer, REGISTRY.index(self.entry))


def layer_ffn_type(cfg, layer: int) -> str:
  """The feed-forward type of block `layer` (a mixed model's layers outside ffn_layers keep dense_ffn)."""
  return config_lib.layer_ffn_config(cfg, layer).type


def served(entry: StandardName, cfg, layer: int | None = None) -> bool:
  """Whether the model serves `entry` at `layer` (None: at some layer). Feed-forward names follow each
  block's own type, so a mixed model serves gate names only at its sparse layers."""
  if entry.ffn_types is ALL_FFN:
    return True
  layers = range(cfg.n_layers) if layer is None else (layer,)
  return any(layer_ffn_type(cfg, i) in entry.ffn_types for i in layers)


def full_name(entry: StandardName, layer: int | None) -> str:
  if entry.scope == "model":
    return entry.name
  scope = "" if entry.scope == "layer" else f"{entry.scope}."
  return f"layers[{layer}].{scope}{entry.name}"


def served_names(cfg) -> list[str]:
  """Every full name a model with config `cfg` (config.model) serves, in forward order."""
  names = []
  for entry in REGISTRY:
    if served(entry, cfg):
      layers = [None] if entry.scope == "model" else [i for i in range(cfg.n_layers) if served(entry, cfg, i)]
      names += [full_name(entry, layer) for layer in layers]
  return sorted(names, key=lambda name: resolve(name, cfg).order)


def resolve(name: str, cfg) -> Resolved:
  """The entry behind a full name, refusing a name this model does not serve with the reason."""
  match = _FULL.match(name)
  entry = BY_NAME.get(match.group(3)) if match else None
  if entry is None:
    raise KeyError(
      f"{name!r} is not a standard name; see sparsetx.interp.names.REGISTRY (e.g. layers[0].layer_output)."
    )
  layer = None if match.group(1) is None else int(match.group(1))
  scope = "model" if layer is None else (match.group(2) or "layer")
  if scope != entry.scope:
    raise KeyError(f"{name!r} has the wrong scope; write it as {full_name(entry, 0 if layer is None else layer)!r}.")
  if layer is not None and not 0 <= layer < cfg.n_layers:
    raise KeyError(f"{name!r}: the model has layers 0..{cfg.n_layers - 1}.")
  if not served(entry, cfg, layer):
    raise KeyError(f"{name!r} exists only for feed-forward types {entry.ffn_types}; {_ffn_types_text(cfg, layer)}.")
  return Resolved(name, entry, layer)


def _ffn_types_text(cfg, layer: int | None) -> str:
  if not config_lib.is_mixed(cfg):
    return f"this model's is {cfg.ffn.type!r}"
  where = f"layer {layer} of this model is {layer_ffn_type(cfg, layer)!r}; " if layer is not None else ""
  sparse = ", ".join(map(str, config_lib.ffn_layer_indices(cfg)))
  return f"{where}this mixed model has {cfg.ffn.type!r} in layers {sparse} and {cfg.dense_ffn.type!r} in the others"


def axis_sizes(cfg, batch: int, seq: int, layer: int | None = None) -> dict:
  """Sizes of the layout axes for a model config (config.model) and a [batch, seq] input; the feed-forward
  axes are those of block `layer` (default: config.model.ffn)."""
  ffn = cfg.ffn if layer is None else config_lib.layer_ffn_config(cfg, layer)
  return dict(
    batch=batch,
    seq=seq,
    query=seq,
    key=seq,
    d_model=cfg.d_model,
    vocab_size=cfg.vocab_size,
    heads=cfg.d_model // cfg.head_dim,
    d_ffw=ffn.d_ffw,
    channels=ffn.n_channels,
    top_k=ffn.top_k,
    trees=ffn.n_trees,
    path_length=ffn.depth + 1,
    experts_per_token=ffn.experts_per_token,
  )


def layout_shape(name: str, cfg, batch: int, seq: int) -> tuple:
  """The documented shape of `name` for this model and input size."""
  resolved = resolve(name, cfg)
  sizes = axis_sizes(cfg, batch, seq, resolved.layer)
  return tuple(sizes[axis] for axis in resolved.entry.axes)
