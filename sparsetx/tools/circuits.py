"""Sparse-circuit analysis of a trained checkpoint, end to end (sgatlin paper Sec. 4; FFF paper Sec. 5).

  python -m sparsetx.tools.circuits --workdir=workdir/tiny [--output=workdir/tiny/circuits] [--rows=128]

More: docs/modules.md, sparsetx/tools/circuits.py.
"""

import json
import sys

import numpy as np
from absl import flags

from sparsetx import cli, paths
from sparsetx.config import ConfigError
from sparsetx.interp import checkpoint, circuits, embedding, neighbours, nie, pruning, usage


def _markdown(rows: list[dict]) -> str:
  keys = list(rows[0])
  fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
  return "\n".join(
    ["| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"]
    + ["| " + " | ".join(fmt(row[k]) for k in keys) + " |" for row in rows]
  )


def _plot_visits(visits_by_layer: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  fig, axes = plt.subplots(
    len(visits_by_layer), 1, figsize=(9, 1.2 + 1.1 * len(visits_by_layer)), squeeze=False, sharex=True
  )
  for ax, (layer, visits_PN) in zip(axes[:, 0], visits_by_layer.items()):
    image = ax.imshow(visits_PN, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_ylabel(f"layer {layer}\ntree")
    # Whole trees and nodes only, few enough to keep the labels apart in a row about an inch high.
    ax.yaxis.set_major_locator(ticker.MaxNLocator(nbins=3, integer=True))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=12, integer=True))
  axes[-1, 0].set_xlabel("node (heap order: root, level 1, ..., leaves)")
  fig.colorbar(image, ax=axes[:, 0].tolist(), label="fraction of tokens visiting")
  paths.save_figure(fig, path)
  plt.close(fig)


def _plot_pruning(results: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot([r["fraction"] for r in results], [r["loss"] for r in results], marker="o")
  ax.set_xlabel("fraction of nodes pruned (least visited first)")
  ax.set_ylabel("validation loss")
  ax.ticklabel_format(axis="both", style="plain", useOffset=False)  # 4.35456, not 1e-6 + 4.35455
  ax.grid(alpha=0.3)
  fig.tight_layout()
  paths.save_figure(fig, path)
  plt.close(fig)


def analyse(args) -> dict:
  config, model, step = checkpoint.load(args.workdir, args.step)
  cfg = model.cfg
  layers = circuits.sparse_layers(cfg)  # refuses a model without sparse circuits
  # default: the penultimate layer, or the nearest sparse layer below it (the first sparse layer if none is)
  neighbour_layer = (
    args.layer if args.layer is not None else max([i for i in layers if i <= cfg.n_layers - 2], default=layers[0])
  )
  circuits.check_layer(cfg, neighbour_layer, "--layer")  # before anything is computed or written
  out = paths.resolve(args.output) if args.output else paths.resolve(args.workdir) / "circuits"  # local or gs://
  out.mkdir(parents=True, exist_ok=True)
  vocabulary = checkpoint.vocabulary(config)
  summary = dict(step=int(step), ffn_type=cfg.ffn.type, sparse_layers=list(layers), files=[])

  def write(name: str, text: str) -> None:
    (out / name).write_text(text + "\n")
    summary["files"].append(name)

  write("model.txt", str(model))
  rows = checkpoint.validation_rows(config, args.rows)
  db = circuits.record(model, rows, context=args.context)
  db.save(out / "circuits.npz")
  summary["files"].append("circuits.npz")
  summary["database_tokens"] = len(db)
  print(f"step {step}: {len(db)} tokens of {len(rows['inputs'])} validation rows in the circuit database")

  table = usage.usage_table(cfg, db)
  text = ["# Unit usage over the validation rows", "", _markdown(table)]
  for layer in layers:
    pairs = usage.top_pairs(cfg, db, layer)
    if pairs:
      text += ["", f"## Layer {layer}: most co-activated units (lift over independence)", "", _markdown(pairs)]
  circuit = circuits.circuit_of(cfg)  # FfnSpec.circuit: which analyses apply
  if circuit.tree_paths:
    fff_paths = usage.fff_path_table(cfg, db)
    text += ["", "## FFF paths (leaves) per tree", "", _markdown(fff_paths)]
    summary["fff_paths"] = fff_paths
    balance = usage.fff_balance_table(cfg, db)
    text += [
      "",
      "## FFF routing balance (balanced: every Gini 0, left turns 0.5, leftmost leaf 2**-depth)",
      "",
      _markdown(balance),
    ]
    summary["fff_balance"] = balance
  write("usage.md", "\n".join(text))
  summary["usage"] = table
  print(_markdown(table))

  prompt = checkpoint.encode_prompt(vocabulary, args.sentence)
  found = neighbours.nearest(model, db, prompt, neighbour_layer, args.neighbours)
  write(
    "neighbours.md",
    "\n".join(
      [
        f"# Nearest circuits at layer {neighbour_layer} for: {args.sentence!r}",
        "",
        "Each column is a token of the sentence; row r holds the input token of its r-th nearest circuit and "
        "the cosine distance.",
        "",
        neighbours.format_table(vocabulary, db, found),
        "",
        "## Contexts and predictions of the nearest circuits",
        "",
        neighbours.format_extended(vocabulary, db, found),
      ]
    ),
  )
  print(f"nearest circuits at layer {neighbour_layer}:\n" + neighbours.format_table(vocabulary, db, found))

  for layer_i in layers:
    points = embedding.embed(cfg, db, layer_i, n_tokens=args.embed_tokens, per_token=args.per_token)
    embedding.plot(vocabulary, points, out / f"embedding_layer{layer_i}.png")
    summary["files"].append(f"embedding_layer{layer_i}.png")
    summary["embedding_method"] = points.method

  if circuit.patchable:
    result = nie.run(model, nie.fact_pairs(vocabulary), min_effect=args.min_effect)
    write(
      "nie.md",
      "# Normalized indirect effect of patching the gates (rows: layers, columns: positions)\n\n"
      + nie.format_table(result),
    )
    nie.plot(result, out / "nie.png", title=f"NIE of patching {cfg.ffn.type} gates (step {step})")
    summary["files"].append("nie.png")
    summary["nie"] = dict(
      rows=result.row_labels,
      columns=result.col_labels,
      values=np.where(np.isfinite(result.nie_RC), result.nie_RC, None).tolist(),
      kept_pairs=int(result.kept_B.sum()),
      pairs=len(result.kept_B),
      not_available=result.reasons,
    )
    print(nie.format_table(result))

  if circuit.tree_paths:
    visits = {layer_i: usage.fff_visits(cfg, db, layer_i)[0] for layer_i in layers}
    _plot_visits(visits, out / "fff_visits.png")
    summary["files"].append("fff_visits.png")
    fractions = [float(f) for f in args.prune_fractions.split(",")]
    results = pruning.sweep(model, db, rows, fractions)
    write(
      "pruning.md", "# Validation loss against the fraction of least-visited FFF nodes pruned\n\n" + _markdown(results)
    )
    _plot_pruning(results, out / "pruning.png")
    summary["files"].append("pruning.png")
    summary["pruning"] = results
    print(_markdown(results))

  summary["files"].append("summary.json")
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  print(f"wrote {', '.join(summary['files'])} to {out}")
  return summary


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict:
  """The program's absl flags; defined only when run as a program (or into a test's own FlagValues)."""
  fv = dict(flag_values=flag_values)
  return dict(
    workdir=flags.DEFINE_string("workdir", None, "A training workdir (holds checkpoints/).", required=True, **fv),
    step=flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", **fv),
    output=flags.DEFINE_string("output", None, "Directory for the tables and PNGs (default <workdir>/circuits).", **fv),
    rows=flags.DEFINE_integer("rows", 128, "Validation rows recorded into the circuit database.", **fv),
    context=flags.DEFINE_integer("context", 12, "Preceding tokens stored with each circuit.", **fv),
    sentence=flags.DEFINE_string(
      "sentence",
      "A big dog named Rex had a red collar. He wore it every day.",
      "Sentence whose circuits get neighbours (best not verbatim in the validation split).",
      **fv,
    ),
    layer=flags.DEFINE_integer(
      "layer", None, "Sparse layer of the neighbour table (default: penultimate, or the sparse layer below).", **fv
    ),
    neighbours=flags.DEFINE_integer("neighbours", 10, "Nearest circuits listed per token.", **fv),
    embed_tokens=flags.DEFINE_integer("embed_tokens", 20, "Most frequent tokens in the 2-D map.", **fv),
    per_token=flags.DEFINE_integer("per_token", 40, "Circuits per token in the 2-D map.", **fv),
    min_effect=flags.DEFINE_float("min_effect", 0.5, "NIE: least total effect (logits) of a kept pair.", **fv),
    prune_fractions=flags.DEFINE_string(
      "prune_fractions", "0,0.1,0.25,0.5,0.75", "FFF: comma-separated fractions.", **fv
    ),
  )


def absl_main(argv: list[str], flag_values: dict) -> int:
  del argv  # words that are no flags: refused by cli.run
  args = cli.flag_values(flag_values)
  try:
    analyse(args)
  except (ConfigError, ValueError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  return 0


def main():
  """The `sparsetx-circuits` entry point."""
  values = define_flags()
  cli.run(lambda argv: absl_main(argv, values))


if __name__ == "__main__":
  main()
