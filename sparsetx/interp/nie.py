"""Causal patching of feed-forward circuits on factual recall: the normalized indirect effect (NIE)
per layer and position (sgatlin paper Sec. 4.3, Fig. 7).

More: docs/modules.md, sparsetx/interp/nie.py.
"""

import dataclasses

import numpy as np

from sparsetx import paths
from sparsetx.data import corpus
from sparsetx.interp import circuits as circuits_lib
from sparsetx.interp.checkpoint import START_ID, encode_prompt
from sparsetx.interp.trace import Patch
from sparsetx.models.ffn.registry import SPECS

POSITION_SETS = ("noun_first", "noun_last", "was", "last", "all")
# The types whose circuit a do(g = g_patch) can clamp (FfnSpec.circuit.patchable).
PATCHABLE_TYPES = tuple(name for name, spec in SPECS.items() if spec.circuit is not None and spec.circuit.patchable)


@dataclasses.dataclass
class PromptPairs:
  clean_BT: np.ndarray
  patch_BT: np.ndarray
  positions_BT: np.ndarray
  segment_ids_BT: np.ndarray
  y_clean_B: np.ndarray
  y_patch_B: np.ndarray
  masks: dict  # position set -> bool [B, T]
  nouns: list  # (clean noun, counterfactual noun)


def _prompt(vocabulary, noun: str, adjective: str):
  """(prompt ids, target id, noun_first, noun_last) for "The <noun> was" -> adjective."""
  stem = encode_prompt(vocabulary, f"The {noun} was")
  full = encode_prompt(vocabulary, f"The {noun} was {adjective}")
  if full[: len(stem)] != stem:
    raise ValueError(f"the vocabulary does not tokenize 'The {noun} was' as a prefix of the fact sentence.")
  if not vocabulary.decode([full[len(stem)]]).strip():  # byte-level: the space is its own token
    stem = full[: len(stem) + 1]
  article = encode_prompt(vocabulary, "The ")
  with_noun = encode_prompt(vocabulary, f"The {noun}")
  noun_first = len(article) if with_noun[: len(article)] == article else len(article) - 1
  return stem, full[len(stem)], noun_first, len(with_noun) - 1


def fact_pairs(vocabulary, facts=None) -> PromptPairs:
  """Clean/counterfactual pairs: each fact paired with the next fact (in table order) whose prompt
  has the same length and whose target token differs."""
  facts = list(facts or corpus.facts())
  prompts = [_prompt(vocabulary, noun, adjective) for noun, adjective in facts]
  chosen = []
  for i, (ids, target, _, _) in enumerate(prompts):
    for step in range(1, len(prompts)):
      j = (i + step) % len(prompts)
      if len(prompts[j][0]) == len(ids) and prompts[j][1] != target:
        chosen.append((i, j))
        break
  if not chosen:
    raise ValueError("no two facts give prompts of equal length with different targets.")
  T = max(len(prompts[i][0]) for i, _ in chosen)
  B = len(chosen)
  clean, patch = np.full((B, T), START_ID, np.int32), np.full((B, T), START_ID, np.int32)
  positions, segments = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  masks = {name: np.zeros((B, T), bool) for name in POSITION_SETS}
  for b, (i, j) in enumerate(chosen):
    (ids, _, first, last), n = prompts[i], len(prompts[i][0])
    pad = T - n
    clean[b, pad:], patch[b, pad:] = ids, prompts[j][0]
    positions[b, pad:], segments[b, pad:] = np.arange(n), 1
    masks["noun_first"][b, pad + first] = True
    masks["noun_last"][b, pad + last] = True
    masks["was"][b, pad + last + 1 : T - 1] = True
    masks["last"][b, T - 1] = True
    masks["all"][b, pad:] = True
  return PromptPairs(
    clean,
    patch,
    positions,
    segments,
    np.array([prompts[i][1] for i, _ in chosen]),
    np.array([prompts[j][1] for _, j in chosen]),
    masks,
    [(facts[i][0], facts[j][0]) for i, j in chosen],
  )


def gate_names(cfg, layer: int) -> tuple[str, str]:
  """The circuit's gates at a layer: what a do(g = g_patch) clamps."""
  kind = cfg.ffn.type
  if SPECS[kind].circuit is not None and SPECS[kind].circuit.patchable:
    return circuits_lib.circuit_names(cfg, layer)  # refuses a mixed model's dense layer
  raise ValueError(
    f"config.model.ffn.type={kind!r} has no gates to patch (FFF routing is the forward pass; dense layers have none); "
    f"NIE patching needs one of {', '.join(PATCHABLE_TYPES)}."
  )


def logit_difference(logits_BTV, y_clean_B, y_patch_B) -> np.ndarray:
  last = np.asarray(logits_BTV)[:, -1]
  rows = np.arange(len(last))
  return last[rows, y_clean_B] - last[rows, y_patch_B]


@dataclasses.dataclass
class NieResult:
  row_labels: list  # the sparse layers' indices ("0", "1", ...) and "all"
  col_labels: list  # POSITION_SETS
  nie_RC: np.ndarray  # mean NIE over the kept pairs
  per_pair_RCB: np.ndarray  # NIE of every pair (nan where the pair was not kept)
  m_clean_B: np.ndarray
  m_patch_B: np.ndarray
  kept_B: np.ndarray
  clean_gates: dict  # the clean run's own gates ({name: array}); patching them back must give NIE 0
  reasons: list = dataclasses.field(default_factory=list)  # why cells are n/a, one sentence each
  min_effect: float = 0.0


def run(model, pairs: PromptPairs, min_effect: float = 0.5, source_gates: dict | None = None) -> NieResult:
  """The NIE table: rows = single sparse layers and all of them together, columns = position sets.

  `source_gates` overrides the patched values ({name: array}); by default they are the
  counterfactual run's gates (passing the clean run's own gates must give NIE 0). Every run,
  the unpatched clean and counterfactual ones included, is the same compiled program with
  different masks, so the clean baseline differs from a patched run only by what is patched.
  """
  cfg = model.cfg
  layers = circuits_lib.sparse_layers(cfg)
  names = [name for layer in layers for name in gate_names(cfg, layer)]
  kw = dict(positions_BT=pairs.positions_BT, segment_ids_BT=pairs.segment_ids_BT)
  shapes = model.eval_shapes(*pairs.clean_BT.shape, names)
  nothing = {name: np.zeros(s.shape, s.dtype) for name, s in shapes.items()}
  off = np.zeros_like(pairs.masks["all"])

  def forward(tokens_BT, values, patched_layers, mask_BT):
    patches = {
      name: Patch(values[name], mask_BT if layer in patched_layers else off)
      for layer in layers
      for name in gate_names(cfg, layer)
    }
    out = model.patch(tokens_BT, patches, names + ["logits"], **kw)
    return out, logit_difference(out["logits"], pairs.y_clean_B, pairs.y_patch_B)

  counter, m_patch = forward(pairs.patch_BT, nothing, (), off)  # every mask off: the plain counterfactual run
  gates = source_gates or {name: counter[name] for name in names}
  clean, m_clean = forward(pairs.clean_BT, gates, (), off)
  total = m_patch - m_clean
  kept = np.abs(total) >= min_effect
  layer_sets = [(layer,) for layer in layers] + [layers]
  per_pair = np.full((len(layer_sets), len(POSITION_SETS), len(total)), np.nan)
  for r, patched_layers in enumerate(layer_sets):
    for c, position_set in enumerate(POSITION_SETS):
      counted = kept & pairs.masks[position_set].any(-1)  # patching no position measures nothing
      effect = forward(pairs.clean_BT, gates, patched_layers, pairs.masks[position_set])[1] - m_clean
      per_pair[r, c] = np.where(counted, effect / np.where(counted, total, 1.0), np.nan)
  finite = np.isfinite(per_pair).sum(-1)
  nie = np.where(finite > 0, np.nansum(per_pair, -1) / np.maximum(finite, 1), np.nan)
  rows = [str(layer) for layer in layers] + ["all"]
  clean_gates = {name: clean[name] for name in names}
  return NieResult(
    rows,
    list(POSITION_SETS),
    nie,
    per_pair,
    m_clean,
    m_patch,
    kept,
    clean_gates,
    reasons=na_reasons(pairs, kept, min_effect),
    min_effect=min_effect,
  )


def na_reasons(pairs: PromptPairs, kept_B: np.ndarray, min_effect: float) -> list:
  """Why a column (or the whole table) has no NIE: no pair passed the total-effect threshold, or the
  prompts of the passing pairs hold no token of that position set."""
  if not kept_B.any():
    return [
      f"n/a everywhere: 0 of {len(kept_B)} pairs have a total effect |m(x_patch) - m(x_clean)| of at least "
      f"{min_effect:g} logits (min_effect); the model does not yet tell the facts apart, or lower min_effect."
    ]
  present = [name for name in POSITION_SETS if pairs.masks[name][kept_B].any()]
  return [
    f"n/a in column {name}: the prompts of the {int(kept_B.sum())} kept pairs have no {name} position (this "
    f"vocabulary's prompts hold {', '.join(present)})"
    for name in POSITION_SETS
    if name not in present
  ]


def format_table(result: NieResult) -> str:
  lines = ["| layer | " + " | ".join(result.col_labels) + " |", "|---" * (len(result.col_labels) + 1) + "|"]
  for label, values in zip(result.row_labels, result.nie_RC):
    lines.append(f"| {label} | " + " | ".join(_cell(v) for v in values) + " |")
  kept, total = int(result.kept_B.sum()), len(result.kept_B)
  lines.append(
    f"\n{kept} of {total} pairs have a total effect |m(x_patch) - m(x_clean)| of at least "
    f"{result.min_effect:g} logits; mean total effect {np.mean(result.m_patch_B - result.m_clean_B):+.3f} logits."
  )
  lines += result.reasons
  return "\n".join(lines)


def _cell(value: float) -> str:
  return f"{value:+.3f}" if np.isfinite(value) else "n/a"


def plot(result: NieResult, path: str, title: str = "NIE of patching the gates") -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(1.3 * len(result.col_labels) + 2, 0.6 * len(result.row_labels) + 1.5))
  limit = max(float(np.nanmax(np.abs(result.nie_RC))) if np.isfinite(result.nie_RC).any() else 1.0, 1e-3)
  image = ax.imshow(np.nan_to_num(result.nie_RC), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
  ax.set_xticks(range(len(result.col_labels)), result.col_labels, rotation=20, ha="right")
  ax.set_yticks(
    range(len(result.row_labels)), [f"layer {r}" if r != "all" else "all layers" for r in result.row_labels]
  )
  for (r, c), value in np.ndenumerate(result.nie_RC):
    ax.text(c, r, f"{value:.2f}" if np.isfinite(value) else "n/a", ha="center", va="center", fontsize=8)
  ax.set_xlabel("positions patched")
  ax.set_ylabel("gates patched")
  ax.set_title(title)
  fig.colorbar(image, ax=ax, label="NIE")
  fig.tight_layout()
  paths.save_figure(fig, path)
  plt.close(fig)
