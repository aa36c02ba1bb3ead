"""The printout of a model by its standard names, like nnterp's `print(model)`.

Lists the native modules (from the parameter tree, with shapes), under the standard scope names
(`self_attn/attention`, `mlp`), and after each module the standard values it serves with layout and
meaning. Identical blocks are printed once as `(0-N): N x Block`; a mixed model (config.model.ffn_layers)
prints each run of blocks with the same feed-forward type on its own.
"""

import itertools

import numpy as np

from sparsetx import config as config_lib
from sparsetx.interp import names as names_lib
from sparsetx.models.ffn.registry import FFN_LAYERS

_NATIVE = {"attention": "self_attn/attention", "mlp": "mlp"}


def _classes(cfg, layer: int) -> dict:
  norm = "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm"
  mlp = FFN_LAYERS[names_lib.layer_ffn_type(cfg, layer)].__name__
  return dict(
    embed="Embed",
    attention="Attention",
    attention_norm=norm,
    mlp_norm=norm,
    final_norm=norm,
    lm_head="Dense",
    mlp=mlp,
    router="Router",
    query="Dense",
    keys="Dense",
    key="Dense",
    value="Dense",
    out="Dense",
    wi="Dense",
    wo="Dense",
    wi_gate="Dense",
    wi_up="Dense",
  )


def _module_lines(tree: dict, indent: str, classes: dict) -> list[str]:
  lines = []
  for key, sub in tree.items():
    leaves = {k: v for k, v in sub.items() if not isinstance(v, dict)} if isinstance(sub, dict) else {}
    children = {k: v for k, v in sub.items() if isinstance(v, dict)} if isinstance(sub, dict) else {}
    shapes = ", ".join(f"{k}{tuple(np.shape(v))}" for k, v in leaves.items())
    lines.append(f"{indent}({_NATIVE.get(key, key)}): {classes.get(key, 'Module')}({shapes})")
    lines += _module_lines(children, indent + "  ", classes)
  return lines


def _name_lines(cfg, scope: str, indent: str, layer: int | None = None) -> list[str]:
  return [
    f"{indent}({entry.name}) -> {entry.layout}: {entry.meaning}"
    for entry in names_lib.REGISTRY
    if entry.scope == scope and names_lib.served(entry, cfg, layer)
  ]


def _block_groups(cfg) -> list[list[int]]:
  """Runs of consecutive blocks with the same feed-forward type (one run unless the model is mixed)."""
  by_type = itertools.groupby(range(cfg.n_layers), lambda layer: names_lib.layer_ffn_type(cfg, layer))
  return [list(group) for _, group in by_type]


def describe(cfg, params) -> str:
  """The printout: modules with parameter shapes and the standard names they serve."""
  head = "tied to embed" if cfg.tie_embeddings else "lm_head"
  ffn = cfg.ffn.type
  if config_lib.is_mixed(cfg):
    ffn += f" in layers {cfg.ffn_layers}, {cfg.dense_ffn.type} in the others"
  lines = [
    f"Transformer(ffn={ffn}, block={cfg.block}, norm={cfg.norm}, n_layers={cfg.n_layers}, "
    f"d_model={cfg.d_model}, heads={cfg.d_model // cfg.head_dim}, vocab_size={cfg.vocab_size}, head={head}) ("
  ]
  classes = _classes(cfg, 0)
  top = {k: v for k, v in params.items() if not k.startswith("layers_")}
  lines += _module_lines({k: top[k] for k in top if k not in ("final_norm", "lm_head")}, "  ", classes)
  lines.append("  (layers): ModuleList(")
  for group in _block_groups(cfg):
    first, n = group[0], len(group)
    lines.append(f"    ({first}-{group[-1]}): {n} x Block(" if n > 1 else f"    ({first}): Block(")
    block, classes = params[f"layers_{first}"], _classes(cfg, first)
    for key in block:
      lines += _module_lines({key: block[key]}, "      ", classes)
      if key == "attention":
        lines += _name_lines(cfg, "self_attn", "        ", first)
      if key == "mlp":
        lines += _name_lines(cfg, "mlp", "        ", first)
    lines += _name_lines(cfg, "layer", "      ", first)
    lines.append("    )")
  lines.append("  )")
  lines += _module_lines({k: top[k] for k in ("final_norm", "lm_head") if k in top}, "  ", classes)
  lines += _name_lines(cfg, "model", "  ")
  lines.append(")")
  return "\n".join(lines)
