"""The printout of a model by its standard names, like nnterp's `print(model)`.

Lists the native modules (from the parameter tree, with shapes), under the standard scope names
(`self_attn/attention`, `mlp`), and after each module the standard values it serves with layout and
meaning. Blocks are identical, so they are printed once as `(0-N): N x Block`.
"""

import numpy as np

from sparsetx.interp import names as names_lib
from sparsetx.models.ffn.registry import FFN_LAYERS

_NATIVE = {"attention": "self_attn/attention", "mlp": "mlp"}


def _classes(cfg) -> dict:
  norm = "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm"
  return dict(embed="Embed", attention="Attention", attention_norm=norm, mlp_norm=norm, final_norm=norm,
              lm_head="Dense", mlp=FFN_LAYERS[cfg.ffn.type].__name__, router="Router", query="Dense", keys="Dense",
              key="Dense", value="Dense", out="Dense", wi="Dense", wo="Dense", wi_gate="Dense", wi_up="Dense")


def _module_lines(tree: dict, indent: str, classes: dict) -> list[str]:
  lines = []
  for key, sub in tree.items():
    leaves = {k: v for k, v in sub.items() if not isinstance(v, dict)} if isinstance(sub, dict) else {}
    children = {k: v for k, v in sub.items() if isinstance(v, dict)} if isinstance(sub, dict) else {}
    shapes = ", ".join(f"{k}{tuple(np.shape(v))}" for k, v in leaves.items())
    lines.append(f"{indent}({_NATIVE.get(key, key)}): {classes.get(key, 'Module')}({shapes})")
    lines += _module_lines(children, indent + "  ", classes)
  return lines


def _name_lines(cfg, scope: str, indent: str) -> list[str]:
  return [
      f"{indent}({entry.name}) -> {entry.layout}: {entry.meaning}"
      for entry in names_lib.REGISTRY
      if entry.scope == scope and names_lib.served(entry, cfg)
  ]


def describe(cfg, params) -> str:
  """The printout: modules with parameter shapes and the standard names they serve."""
  ffn, classes = cfg.ffn.type, _classes(cfg)
  head = "tied to embed" if cfg.tie_embeddings else "lm_head"
  lines = [
      f"Transformer(ffn={ffn}, block={cfg.block}, norm={cfg.norm}, n_layers={cfg.n_layers}, "
      f"d_model={cfg.d_model}, heads={cfg.d_model // cfg.head_dim}, vocab_size={cfg.vocab_size}, head={head}) ("
  ]
  top = {k: v for k, v in params.items() if not k.startswith("layers_")}
  lines += _module_lines({k: top[k] for k in top if k not in ("final_norm", "lm_head")}, "  ", classes)
  n = cfg.n_layers
  lines.append("  (layers): ModuleList(")
  lines.append(f"    (0-{n - 1}): {n} x Block(" if n > 1 else "    (0): Block(")
  block = params["layers_0"]
  for key in block:
    lines += _module_lines({key: block[key]}, "      ", classes)
    if key == "attention":
      lines += _name_lines(cfg, "self_attn", "        ")
    if key == "mlp":
      lines += _name_lines(cfg, "mlp", "        ")
  lines += _name_lines(cfg, "layer", "      ")
  lines += ["    )", "  )"]
  lines += _module_lines({k: top[k] for k in ("final_norm", "lm_head") if k in top}, "  ", classes)
  lines += _name_lines(cfg, "model", "  ")
  lines.append(")")
  return "\n".join(lines)
