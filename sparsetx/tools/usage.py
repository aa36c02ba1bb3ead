"""One picture of a run's sparse layers over time: `sparsetx-usage --workdir=W [--out=W/usage.png]`.

Top: each layer's dead fraction, KL of its usage from uniform and device load (the busiest device's routed work over
the mean on the run's mesh, BALANCED_COLOUR at 1) at the end of each window the trainer logged to metrics.jsonl
(usage/layers_i/*), each point labelled with its window's length in steps. Below: the last window's
counts (<workdir>/usage_last_window.npz) as heat maps on a log scale from 0, a unit never picked in its own colour
(ZERO_COLOUR): per sgatlin or PEER layer the sub-keys of both halves, divided, per MoE layer its experts, per FFF
layer each tree's leaves. More: README, "Sparse layers' health".
"""

import json

import ml_collections
import numpy as np
from absl import flags

from sparsetx import cli, paths
from sparsetx import config as config_lib
from sparsetx.config import ConfigError

ZERO_COLOUR = "deepskyblue"  # a unit with no pick in the window: outside the colour map's black-to-yellow range
BALANCED_COLOUR = "limegreen"  # the device load panel's line at 1 (every device as busy as the mean)
LINES = (
  ("dead", "dead fraction"),
  ("kl_uniform", "KL from uniform (nats)"),
  ("device_load", "device load (max / mean)"),
)


def define_flags() -> dict:
  """The program's absl flags; defined only when run as a program, so tests import this module next to others."""
  return dict(
    workdir=flags.DEFINE_string("workdir", None, "The training run."),
    out=flags.DEFINE_string("out", None, "The PNG to write (default: <workdir>/usage.png)."),
  )


def windows(workdir) -> dict[str, dict[str, list]]:
  """{layer: {stat: [(step, value)]}} of the usage/ rows of metrics.jsonl."""
  found = {}
  path = paths.resolve(workdir) / "metrics.jsonl"
  if not path.exists():
    raise ConfigError(f"--workdir={workdir!r} has no metrics.jsonl; give the workdir of a training run.")
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:  # a row cut short by a kill
      continue
    for key, value in row.items():
      if key.startswith("usage/"):
        _, layer, stat = key.split("/")
        found.setdefault(layer, {}).setdefault(stat, []).append((row["step"], value))
  if not found:
    raise ConfigError(
      f"metrics.jsonl in {workdir!r} holds no usage/ rows: the run has no sparse layer, or logged no window yet "
      "(config.train.usage_window)."
    )
  return found


def heat_map(ffn, counts_U) -> np.ndarray:
  """The last window's counts as rows to draw: sub-keys of both halves per channel, experts, or leaves per tree."""
  from sparsetx.models.ffn.registry import SPECS  # noqa: PLC0415  (after flags: a fast --help)

  rows = SPECS[ffn["type"]].count_rows
  return rows(ffn, counts_U) if rows else counts_U.reshape(1, -1)


def halves(ffn) -> bool:
  """Whether the heat map's columns are the two halves of product-key sub-keys (divided in the picture)."""
  from sparsetx.models.ffn.registry import SPECS  # noqa: PLC0415
  from sparsetx.models.ffn.spec import subkey_rows  # noqa: PLC0415

  return SPECS[ffn["type"]].count_rows is subkey_rows


def window_lengths(steps) -> list[int]:
  """Each logged window's length in steps: from the step the one before it ended (0 for the first)."""
  return [int(b - a) for a, b in zip((0, *steps[:-1]), steps)]


def axis_labels(ffn, rows: int) -> tuple[str, str]:
  """(x, y) labels of a layer's heat map."""
  if halves(ffn):
    return "sub-key: half 1 | half 2", "channel" if rows > 1 else ""
  if ffn["type"] == "fff":
    return "leaf", "tree"
  return ("expert", "") if ffn["type"] == "moe" else ("unit", "")


def load_label(layer_series: dict, layer: str, stat: str) -> str:
  """A layer's legend entry; on the device load panel with the devices its units are split over (load_devices)."""
  split = layer_series.get("load_devices")
  if stat != "device_load" or not split:
    return layer
  n = int(split[-1][1])
  return f"{layer} ({n} device{'s' if n > 1 else ''})"


def not_logged(ax, stat: str) -> None:
  """A line panel of a statistic the run never logged (a run from before it was): a sentence instead of axes."""
  ax.text(0.5, 0.5, f"no usage/*/{stat} in metrics.jsonl (a run from before it was logged)", ha="center", va="center")
  ax.set_xticks([])
  ax.set_yticks([])


def draw(workdir: str, out: str) -> str:
  import matplotlib  # noqa: PLC0415  (after flags: a fast --help)

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # noqa: PLC0415

  series = windows(workdir)
  resolved = paths.resolve(workdir)
  model = ml_collections.ConfigDict(json.loads((resolved / "config.json").read_text())["model"])
  last_path = resolved / "usage_last_window.npz"
  last = dict(np.load(last_path.open("rb"))) if last_path.exists() else {}
  layers = sorted(series, key=lambda name: int(name.removeprefix("layers_")))
  top = len(LINES)
  fig, axes = plt.subplots(top + len(layers), 1, figsize=(9, 7 + 1.6 * len(layers)), squeeze=False)
  for row, (stat, label) in enumerate(LINES):
    ax = axes[row, 0]
    ax.set_ylabel(label)
    if not any(series[layer].get(stat) for layer in layers):
      not_logged(ax, stat)
      continue
    for layer in layers:
      steps, values = zip(*series[layer].get(stat, [])) if series[layer].get(stat) else ((), ())
      ax.plot(steps, values, marker="o", markersize=3, label=load_label(series[layer], layer, stat))
    if stat == "device_load":  # dashed over a layer's line at 1, which shows through the gaps
      ax.axhline(1.0, color=BALANCED_COLOUR, linewidth=1.5, linestyle="--", label="balanced (1)", zorder=3)
      ax.set_ylim(bottom=min(0.9, ax.get_ylim()[0]))
    if steps and row == 0:  # every layer's windows are the same steps: one label per window
      for x, length in zip(steps, window_lengths(steps)):
        ax.annotate(f"{length}", (x, 1.0), xycoords=("data", "axes fraction"), fontsize=7, ha="center", va="bottom")
    ax.set_xlabel("step at the end of each window (above: the window's length in steps)" if row == 0 else "step")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
  step = int(last.pop("step")) if "step" in last else None
  for k, layer in enumerate(layers):
    ax = axes[top + k, 0]
    if layer not in last:
      ax.set_axis_off()
      continue
    ffn = config_lib.layer_ffn_config(model, int(layer.removeprefix("layers_")))
    counts = heat_map(ffn, np.asarray(last[layer]))
    colours = matplotlib.colormaps["magma"].with_extremes(bad=ZERO_COLOUR)
    shown = np.ma.masked_equal(np.log1p(counts.astype(np.float64)), 0.0)  # zero picks: the "bad" colour
    image = ax.imshow(shown, aspect="auto", cmap=colours, vmin=0.0, vmax=max(float(np.log1p(counts.max())), 1.0))
    if halves(ffn):
      ax.axvline(counts.shape[1] / 2 - 0.5, color="white", linewidth=1.5)
    x_label, y_label = axis_labels(ffn, counts.shape[0])
    ax.set_xlabel(x_label, fontsize=8)
    ax.set_ylabel(y_label, fontsize=8)
    if not y_label:
      ax.set_yticks([])
    zeros = int((counts == 0).sum())
    ax.set_title(
      f"{layer} ({ffn.type}), the window ending at step {step}: {zeros} of {counts.size} never picked "
      f"({ZERO_COLOUR} cells)",
      fontsize=9,
    )
    fig.colorbar(image, ax=ax, label="log(1 + picks)")
  fig.tight_layout()
  paths.save_figure(fig, out)
  plt.close(fig)
  return out


def absl_main(argv, holders: dict) -> None:
  del argv
  args = cli.flag_values(holders)
  try:
    if not args.workdir:
      raise ConfigError("--workdir is required: the training run to draw.")
    out = args.out or str(paths.resolve(args.workdir) / "usage.png")
    print(draw(args.workdir, out))
  except ConfigError as error:
    cli.fail(error)


def main():
  """The `sparsetx-usage` entry point."""
  holders = define_flags()
  cli.run(lambda argv: absl_main(argv, holders))


if __name__ == "__main__":
  main()
