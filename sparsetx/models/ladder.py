"""The scaling ladder (sgatlin paper, Listing 2), parameter and FLOP accounting, isoflop token budgets.

More: docs/modules.md, sparsetx/models/ladder.py.
"""

import ml_collections

from sparsetx import config as config_lib
from sparsetx.models.ffn import fff
from sparsetx.models.ffn.registry import SPECS

FFN_TYPES = config_lib.FFN_TYPES
SCALES = range(2, 9)
FFF_DEPTH = fff.LADDER_DEPTH
LADDER_VOCAB = 50_304  # GPT-2 BPE (50,257 tokens) padded to a multiple of 128
LADDER_SEQ_LEN = 2048


def mlp_d_ffw(d_model: int) -> int:
  return int(8 / 3 * d_model / 256) * 256


def _spec(ffn_type: str, label: str = "feed-forward type "):
  if ffn_type not in SPECS:
    raise config_lib.ConfigError(f"{label}{ffn_type!r} is unknown; use one of {', '.join(FFN_TYPES)}.")
  return SPECS[ffn_type]


def ladder_ffn_sizes(scale: int, ffn_type: str) -> dict:
  """The config.model.ffn fields that size `ffn_type` at a rung (each type's FfnSpec.ladder_size)."""
  return _spec(ffn_type).ladder_size(128 * scale)


def scaling_ladder(scale: int, ffn_type: str) -> tuple[int, int, int]:
  """(d_model, n_layers, d_ffw) exactly as Listing 2; for fff d_ffw is the total node count."""
  d_model = 128 * scale
  n_layers = 2 * scale
  sizes = ladder_ffn_sizes(scale, ffn_type)
  d_ffw = sizes["d_ffw"] if "d_ffw" in sizes else SPECS[ffn_type].circuit.size(ml_collections.ConfigDict(sizes))
  return d_model, n_layers, d_ffw


def ladder_model_config(scale: int, ffn_type: str) -> ml_collections.ConfigDict:
  """The full model config of a rung: the papers' transformer (RMSNorm pre-norm, rotary, head dim 64)."""
  if not isinstance(scale, int) or scale < 1:
    raise config_lib.ConfigError(f"ladder scale={scale!r} must be a positive integer (the paper uses 2..8).")
  d_model, n_layers, _ = scaling_ladder(scale, ffn_type)
  model = config_lib.model_defaults()
  model.update(d_model=d_model, n_layers=n_layers, vocab_size=LADDER_VOCAB, max_len=LADDER_SEQ_LEN, remat="full")
  model.ffn.type = ffn_type
  model.ffn.update(ladder_ffn_sizes(scale, ffn_type))
  return model


def _norm_params(model) -> int:
  return model.d_model * (2 if model.norm == "layernorm" else 1)


def _layer_ffns(model) -> list:
  """Each block's feed-forward sub-config (they differ in a partly sparsified model)."""
  return [config_lib.layer_ffn_config(model, i) for i in range(model.n_layers)]


def ffn_params(model, ffn) -> tuple[int, int]:
  """(total, active per token) parameters of one feed-forward layer `ffn` of `model` (its FfnSpec.params)."""
  return _spec(ffn.type, "config.model.ffn.type=").params(model, ffn)


def param_counts(model) -> dict:
  """Total and active (touched per token) parameters; the whole embedding counts as active."""
  D, V = model.d_model, model.vocab_size
  attention = 4 * D * D + int(model.use_bias) * 4 * D
  ffn_total, ffn_active = (sum(counts) for counts in zip(*(ffn_params(model, ffn) for ffn in _layer_ffns(model))))
  shared_per_layer = attention + 2 * _norm_params(model)
  embeddings = V * D * (1 if model.tie_embeddings else 2)
  rest = embeddings + _norm_params(model)
  total = rest + model.n_layers * shared_per_layer + ffn_total
  active = rest + model.n_layers * shared_per_layer + ffn_active
  return dict(total=total, active=active, ffn_total=ffn_total, ffn_active=ffn_active)


def ffn_flops(model, ffn) -> int:
  """Forward FLOPs per token of one feed-forward layer `ffn` of `model` (2 per multiply-accumulate; FfnSpec.flops)."""
  return _spec(ffn.type, "config.model.ffn.type=").flops(model, ffn)


def forward_flops_per_token(model, seq_len: int | None = None) -> dict:
  """Forward FLOPs per token: attention, feed-forward, head and their total."""
  T = seq_len or model.max_len
  D = model.d_model
  attention = 2 * (4 * D * D + 2 * T * D)
  ffn = sum(ffn_flops(model, layer_ffn) for layer_ffn in _layer_ffns(model))
  head = 2 * D * model.vocab_size
  total = model.n_layers * attention + ffn + head
  return dict(attention=model.n_layers * attention, ffn=ffn, head=head, total=total)


def training_tokens(model, flop_budget: float, seq_len: int | None = None) -> int:
  """Tokens that spend `flop_budget` training FLOPs (3 x forward per token)."""
  return int(flop_budget // (3 * forward_flops_per_token(model, seq_len)["total"]))


def ladder_table(flop_budget: float, seq_len: int = LADDER_SEQ_LEN) -> list[dict]:
  rows = []
  for ffn_type in FFN_TYPES:
    for scale in SCALES:
      model = ladder_model_config(scale, ffn_type)
      d_model, n_layers, d_ffw = scaling_ladder(scale, ffn_type)
      params = param_counts(model)
      flops = forward_flops_per_token(model, seq_len)
      rows.append(
        dict(
          ffn=ffn_type,
          scale=scale,
          d_model=d_model,
          n_layers=n_layers,
          d_ffw=d_ffw,
          total_params=params["total"],
          active_params=params["active"],
          fwd_flops=flops["total"],
          tokens=training_tokens(model, flop_budget, seq_len),
        )
      )
  return rows


def format_table(rows: list[dict], flop_budget: float) -> str:
  header = (
    f"{'ffn':<8}{'scale':>6}{'d_model':>9}{'layers':>7}{'d_ffw':>9}{'total':>10}{'active':>10}"
    f"{'GFLOP/tok':>11}{f'tokens @ {flop_budget:.0e}':>18}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
      f"{r['ffn']:<8}{r['scale']:>6}{r['d_model']:>9}{r['n_layers']:>7}{r['d_ffw']:>9}"
      f"{r['total_params'] / 1e6:>9.1f}M{r['active_params'] / 1e6:>9.1f}M{r['fwd_flops'] / 1e9:>11.3f}"
      f"{r['tokens'] / 1e9:>17.2f}B"
    )
  return "\n".join(lines)
