"""Every figure the tools write can be read: labelled axes, tick labels that do not overlap, legends off the
data (outside the axes), plain numbers on the axes (no '1e-6 + 4.35455' offset). Each plot is drawn from
synthetic values shaped like the tool's own (the sizes that crowded ticks before); nothing is trained."""

import itertools

import matplotlib
import numpy as np
import pytest

from sparsetx import paths
from sparsetx.interp import embedding, nie
from sparsetx.tools import circuits, sweep

matplotlib.use("Agg")


@pytest.fixture
def drawn(monkeypatch):
  """The figures the plot functions save, drawn (so tick labels and legends have their final places)."""
  figures = []

  def keep(fig, path, dpi=110):
    fig.canvas.draw()
    figures.append(fig)

  monkeypatch.setattr(paths, "save_figure", keep)
  monkeypatch.setattr(matplotlib.pyplot, "close", lambda fig=None: None)  # inspected after the plot returns
  return figures


class ByteVocabulary:
  def decode(self, ids):
    return bytes(ids).decode("latin-1")


def data_axes(fig):
  return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def visible_tick_labels(axis):
  return [label for label in axis.get_ticklabels() if label.get_visible() and label.get_text()]


def assert_readable(fig, legend_outside: bool = False):
  renderer = fig.canvas.get_renderer()
  for ax in data_axes(fig):
    assert ax.get_xlabel() or not visible_tick_labels(ax.xaxis), "x axis without a label"
    assert ax.get_ylabel(), "y axis without a label"
    for axis in (ax.xaxis, ax.yaxis):
      boxes = [label.get_window_extent(renderer) for label in visible_tick_labels(axis)]
      for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), [label.get_text() for label in visible_tick_labels(axis)]
      assert axis.get_offset_text().get_text() == "", axis.get_offset_text().get_text()
    legend = ax.get_legend()
    if legend is not None and legend_outside:
      assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_embedding_map_has_labelled_axes_and_its_legend_outside(drawn):
  rng = np.random.default_rng(0)
  tokens = np.repeat(np.arange(97, 117), 30)  # 20 tokens, the legend of the tool's default
  points = rng.normal(size=(tokens.size, 2)) + tokens[:, None] % 5
  embedding.plot(ByteVocabulary(), embedding.Embedding(points, tokens, "pca", 1), "unused.png")
  (fig,) = drawn
  assert_readable(fig, legend_outside=True)
  assert data_axes(fig)[0].get_xlabel() == "pca component 1"


def test_pruning_plot_has_plain_axes(drawn):
  results = [dict(fraction=f, loss=4.354551 + 1e-6 * i) for i, f in enumerate((0.0, 0.1, 0.25, 0.5))]
  circuits._plot_pruning(results, "unused.png")
  (fig,) = drawn
  assert_readable(fig)
  assert "4.35455" in " ".join(label.get_text() for label in visible_tick_labels(fig.axes[0].yaxis))


def test_fff_visits_ticks_stay_apart(drawn):
  rng = np.random.default_rng(0)
  visits = {layer: rng.uniform(size=(4, 2**6 - 1)) for layer in range(4)}  # 4 trees of depth 6 per layer
  circuits._plot_visits(visits, "unused.png")
  (fig,) = drawn
  assert_readable(fig)


def test_nie_heatmap_is_readable(drawn):
  labels = ["last", "all", "subject", "first"]
  result = nie.NieResult(["0", "1", "all"], labels, np.linspace(-0.5, 0.7, 12).reshape(3, 4), *([None] * 5))
  nie.plot(result, "unused.png")
  (fig,) = drawn
  assert_readable(fig)


def test_sweep_plots_keep_log_ticks_apart_and_legends_outside(drawn):
  rows = [
    dict(budget=budget, ffn_type=ffn_type, total_params=total, active_params=total / 3, perplexity=9.0 - i / 10)
    for budget in (3e13, 1e14)
    for ffn_type in ("mlp", "sgatlin", "fff")
    for i, total in enumerate((2.1e5, 2.9e5, 4.3e5, 6.2e5, 8.8e5))  # within one decade, as an isoflop curve is
  ]
  sweep.plot_perplexity_vs_size(rows, "unused.png")
  sweep.plot_best_vs_compute(rows, "unused.png")
  for fig in drawn:
    assert_readable(fig, legend_outside=True)
  assert all(visible_tick_labels(ax.xaxis) for ax in data_axes(drawn[0]))  # a decade still has labelled ticks
