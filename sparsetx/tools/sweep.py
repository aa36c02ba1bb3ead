"""Isoflop sweep: for each FLOP budget, trains every feed-forward type at every size on the tokens the budget buys.

More: docs/modules.md, sparsetx/tools/sweep.py.
"""

import dataclasses
import json
import subprocess
import sys

from absl import flags

from sparsetx import cli, paths
from sparsetx.config import ConfigError
from sparsetx.measure import sweep


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    budgets=flags.DEFINE_list("budgets", None, "Training FLOP budgets, e.g. 1e17,6e17."),
    ffn_types=flags.DEFINE_list("ffn_types", ["mlp", "sgatlin"], "Feed-forward types to compare."),
    scales=flags.DEFINE_list("scales", None, "Ladder rungs (configs/ladder.py:FFN,SCALE), e.g. 2,3,4."),
    d_models=flags.DEFINE_list("d_models", None, "Instead of --scales: d_model values on --base_config (CPU-sized)."),
    n_layers=flags.DEFINE_list(
      "n_layers", None, "With --d_models: one layer count per d_model (default: the config's)."
    ),
    base_config=flags.DEFINE_string(
      "base_config", sweep.LADDER_CONFIG, "Config file; takes 'FFN,SCALE' with --scales, 'FFN' with --d_models."
    ),
    overrides=flags.DEFINE_multi_string("overrides", [], "config.FIELD=VALUE for every run (repeat the flag)."),
    workdir=flags.DEFINE_string("workdir", None, "Sweep root: <workdir>/<budget>/<run>/, sweep.json, PNGs."),
    mode=flags.DEFINE_enum("mode", "run", ["run", "print", "collect"], "Train, print commands, or collect only."),
    subprocess=flags.DEFINE_bool("subprocess", False, "Run each training as its printed command in a new process."),
    min_steps=flags.DEFINE_integer("min_steps", 10, "Skip (with a note) runs whose budget buys fewer steps."),
  )


def _ints(name: str, values) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values or ())
  except ValueError:
    raise ConfigError(f"{name}={','.join(values)} must be a comma-separated list of integers.") from None


def spec_from_flags(values: dict) -> sweep.SweepSpec:
  if not values["budgets"]:
    raise ConfigError("--budgets is required; give one or more FLOP budgets, e.g. --budgets=1e17,6e17.")
  if not values["workdir"]:
    raise ConfigError("--workdir is required; give the directory that holds the sweep's runs.")
  try:
    budgets = tuple(float(b) for b in values["budgets"])
  except ValueError:
    raise ConfigError(f"--budgets={','.join(values['budgets'])} must be FLOP counts such as 1e17,6e17.") from None
  return sweep.SweepSpec(
    budgets=budgets,
    ffn_types=tuple(t.strip() for t in values["ffn_types"] or ()),
    workdir=values["workdir"],
    base_config=values["base_config"],
    scales=_ints("--scales", values["scales"]),
    d_models=_ints("--d_models", values["d_models"]),
    n_layers=_ints("--n_layers", values["n_layers"]),
    overrides=tuple(values["overrides"]),
    min_steps=values["min_steps"],
  )


def train(run: sweep.Run, in_subprocess: bool) -> str:
  """Trains one run to its final step; returns 'finished' or 'diverged'."""
  if in_subprocess:
    code = subprocess.run([sys.executable, "-m", "sparsetx.train", *run.args], check=False).returncode
    if code == 3:
      return "diverged"
    if code:
      raise ConfigError(f"run {run.name} failed with exit code {code}; rerun its command to see why: {run.command}")
    return "finished"
  import jax

  from sparsetx.train.run import loop

  try:
    loop.train(run.config, run.workdir)
  except loop.NonFiniteLossError as error:
    print(f"sweep: {run.name} at {run.budget:.3g} FLOPs diverged: {error}", file=sys.stderr)
    return "diverged"
  finally:
    jax.clear_caches()  # one run's compiled programs are not reused by the next
  return "finished"


def collect(runs: list[sweep.Run], mode: str, in_subprocess: bool) -> list[dict]:
  rows = []
  for i, run in enumerate(runs, 1):
    evaluation = sweep.final_eval(run)
    label = f"[{i}/{len(runs)}] {run.name} at {run.budget:.3g} FLOPs ({run.steps} steps)"
    if evaluation is None and mode == "collect":
      print(f"sweep: {label}: not finished, left out", file=sys.stderr)
      continue
    if evaluation is None:
      print(f"sweep: {label}: training", file=sys.stderr)
      status = train(run, in_subprocess)
      evaluation = sweep.final_eval(run) if status == "finished" else None
      if status == "finished" and evaluation is None:
        raise ConfigError(f"run {run.name} stopped before its final step (SIGTERM?); run the sweep again to resume it.")
    else:
      status = "finished"
      print(f"sweep: {label}: already finished, collected", file=sys.stderr)
    rows.append(sweep.result_row(run, evaluation, status))
  return rows


def _plt():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _log_x(ax, engineering: bool) -> None:
  """A log x axis whose labels stay apart: labels at 1, 2 and 5 of each decade only (no minor-tick labels),
  short (300k, 1.2M with `engineering`; else 1e+15), tilted; a plain y axis (no offset)."""
  from matplotlib import ticker

  ax.set_xscale("log")
  ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
  ax.xaxis.set_minor_formatter(ticker.NullFormatter())
  ax.xaxis.set_major_formatter(ticker.EngFormatter(sep="") if engineering else ticker.LogFormatterSciNotation())
  ax.tick_params(axis="x", labelrotation=30)
  ax.ticklabel_format(axis="y", style="plain", useOffset=False)


def plot_perplexity_vs_size(rows: list[dict], path: str) -> None:
  """Figure 3 style: one column per budget, rows: total and active parameters; a line per type."""
  plt = _plt()
  budgets = sorted({r["budget"] for r in rows})
  types = list(dict.fromkeys(r["ffn_type"] for r in rows))
  fig, axes = plt.subplots(2, len(budgets), figsize=(4.2 * len(budgets), 7), squeeze=False, sharey="col")
  for column, budget in enumerate(budgets):
    for row_index, (key, label) in enumerate(
      (("total_params", "total parameters"), ("active_params", "active parameters per token"))
    ):
      ax = axes[row_index, column]
      for color, ffn_type in enumerate(types):
        points = sorted((r[key], r["perplexity"]) for r in rows if r["budget"] == budget and r["ffn_type"] == ffn_type)
        if points:
          ax.plot(*zip(*points), "o-", color=f"C{color}", label=ffn_type)
      _log_x(ax, engineering=True)
      ax.set_xlabel(label)
      ax.grid(alpha=0.3)
      if row_index == 0:
        ax.set_title(f"{budget:.3g} FLOPs")
      ax.set_ylabel("validation perplexity")  # each column has its own scale
  axes[0, -1].legend(title="feed-forward", fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # off the data
  fig.tight_layout()
  paths.save_figure(fig, path)
  plt.close(fig)


def plot_best_vs_compute(rows: list[dict], path: str) -> None:
  """Figure 1 style: per type, the best perplexity over sizes at each budget, labelled with its model size."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  for color, ffn_type in enumerate(dict.fromkeys(r["ffn_type"] for r in rows)):
    best = {}
    for r in rows:
      if r["ffn_type"] == ffn_type and (r["budget"] not in best or r["perplexity"] < best[r["budget"]]["perplexity"]):
        best[r["budget"]] = r
    budgets = sorted(best)
    ax.plot(budgets, [best[b]["perplexity"] for b in budgets], "o-", color=f"C{color}", label=ffn_type)
    for b in budgets:
      ax.annotate(
        f"{best[b]['total_params'] / 1e6:.3g}M",
        (b, best[b]["perplexity"]),
        fontsize=7,
        textcoords="offset points",
        xytext=(4, 4),
        color=f"C{color}",
      )
  _log_x(ax, engineering=False)
  ax.set_xlabel("training FLOP budget")
  ax.set_ylabel("best validation perplexity (label: total parameters)")
  ax.grid(alpha=0.3)
  ax.legend(title="feed-forward", fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # off the data
  fig.tight_layout()
  paths.save_figure(fig, path)
  plt.close(fig)


def write_results(workdir: str, rows: list[dict], skipped: list[sweep.Skipped]) -> None:
  root = paths.resolve(workdir)  # local or gs://
  root.mkdir(parents=True, exist_ok=True)
  summary = dict(
    perplexity="exp(mean over validation tasks of the final-step loss)",
    flops="3 x forward FLOPs per token (sparsetx/models/ladder.py) x trained tokens",
    runs=rows,
    skipped=[dataclasses.asdict(s) for s in skipped],
  )
  path = root / "sweep.json"
  paths.write_text_atomically(path, json.dumps(summary, indent=1))  # a reader never sees half a file
  plotted = [r for r in rows if r["perplexity"] is not None]
  if plotted:
    plot_perplexity_vs_size(plotted, root / "isoflop_perplexity_vs_size.png")
    plot_best_vs_compute(plotted, root / "best_perplexity_vs_compute.png")
  print(f"sweep: {len(rows)} runs in {path}" + (", plots written" if plotted else ", nothing to plot"), file=sys.stderr)


def print_table(rows: list[dict]) -> None:
  """One line per run: its size, the forward FLOPs per token it pays, the tokens they buy, the result."""
  print(
    f"{'budget':>9} {'run':<16}{'total':>10}{'active':>10}{'FLOPs/token':>13}{'steps':>7}{'tokens':>11}  perplexity"
  )
  for r in rows:
    ppl = f"{r['perplexity']:.3f}" if r["perplexity"] is not None else r["status"]
    print(
      f"{r['budget']:>9.3g} {r['name']:<16}{r['total_params']:>10,}{r['active_params']:>10,}"
      f"{r['forward_flops_per_token']:>13,}{r['steps']:>7}{r['trained_tokens']:>11,}  {ppl}"
    )


def run_sweep(spec: sweep.SweepSpec, mode: str = "run", in_subprocess: bool = False) -> list[dict]:
  """Plans the sweep; prints the commands (print), or trains what is unfinished (run) and collects (run, collect)."""
  runs, skipped = sweep.plan(spec)
  for s in skipped:
    print(f"sweep: skipping {s.name} at {s.budget:.3g} FLOPs: {s.reason}.", file=sys.stderr)
  if not runs:
    raise ConfigError("every run of the sweep is too short to train; raise --budgets or lower --min_steps.")
  if mode == "print":
    for run in runs:
      print(run.command)
    return []
  rows = collect(runs, mode, in_subprocess)
  write_results(spec.workdir, rows, skipped)
  print_table(rows)
  return rows


def absl_main(argv, flag_values: dict) -> None:
  del argv  # words that are no flags: refused by cli.run
  values = {name: holder.value for name, holder in flag_values.items()}
  try:
    run_sweep(spec_from_flags(values), values["mode"], values["subprocess"])
  except ConfigError as error:
    cli.fail(error)


def main():
  """The `sparsetx-sweep` entry point."""
  values = define_flags()
  cli.run(lambda argv: absl_main(argv, values))


if __name__ == "__main__":
  main()
