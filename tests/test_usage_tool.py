"""sparsetx-usage (sparsetx/tools/usage.py) draws a run's windows and its last window's counts, and says in one
sentence when the workdir holds nothing to draw."""

import json

import numpy as np
import pytest
from test_train import micro_config

from sparsetx.config import ConfigError
from sparsetx.tools import usage


def test_a_run_with_windows_is_drawn_and_one_without_is_one_sentence(tmp_path):
  config = micro_config("sgatlin")
  config.model.ffn.update(d_ffw=16, n_channels=2)
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
  with pytest.raises(ConfigError, match="has no metrics.jsonl; give the workdir of a training run"):
    usage.draw(str(tmp_path), str(tmp_path / "usage.png"))
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
  with pytest.raises(ConfigError, match="holds no usage/ rows"):
    usage.draw(str(tmp_path), str(tmp_path / "usage.png"))
  rows = [{"step": s, "usage/layers_0/dead": 0.5 - s / 100, "usage/layers_0/kl_uniform": 1.0} for s in (10, 20)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 3')
  counts = np.zeros(32, np.float32)
  counts[4:8] = 5  # channel 0's sub-key 1 of half 1: the only one picked
  np.savez(tmp_path / "usage_last_window.npz", step=20, layers_0=counts)
  heat = usage.heat_map(config.model.ffn.to_dict(), counts)
  np.testing.assert_array_equal(heat[0], [0, 20, 0, 0, 5, 5, 5, 5])  # half 1 | half 2 of channel 0
  assert usage.windows(str(tmp_path))["layers_0"]["dead"] == [(10, 0.4), (20, 0.3)]
  out = usage.draw(str(tmp_path), str(tmp_path / "usage.png"))
  assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def zero_colour_pixels(path) -> int:
  """Pixels of the picture in ZERO_COLOUR (a colour the magma map never takes)."""
  from matplotlib import colors, image

  rgb = (image.imread(path)[..., :3] * 255).round().astype(int)
  want = (np.array(colors.to_rgb(usage.ZERO_COLOUR)) * 255).round().astype(int)
  return int((np.abs(rgb - want).max(-1) <= 2).sum())


def test_the_picture_shows_zero_picks_apart_and_labels_windows_halves_and_axes(tmp_path):
  config = micro_config("sgatlin")
  config.model.ffn.update(d_ffw=16, n_channels=2)
  ffn = config.model.ffn.to_dict()
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
  rows = [{"step": s, "usage/layers_0/dead": 0.1, "usage/layers_0/kl_uniform": 1.0} for s in (200, 300, 340)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
  assert usage.window_lengths([200, 300, 340]) == [200, 100, 40]  # the last, partial window is shorter
  assert usage.halves(ffn) and usage.axis_labels(ffn, 2) == ("sub-key: half 1 | half 2", "channel")
  assert usage.axis_labels(dict(type="fff"), 4) == ("leaf", "tree")

  counts = np.full(32, 3000.0, np.float32)  # every sub-key picked thousands of times: nothing in the zero colour
  np.savez(tmp_path / "usage_last_window.npz", step=340, layers_0=counts)
  assert zero_colour_pixels(usage.draw(str(tmp_path), str(tmp_path / "busy.png"))) == 0
  counts[:4] = 0  # channel 0's sub-key 0 of half 1 is dead (its grid row)
  counts[4:16] = 1  # the rest of channel 0 picked once each: a single pick is no zero
  np.savez(tmp_path / "usage_last_window.npz", step=340, layers_0=counts)
  assert usage.heat_map(ffn, counts)[0].tolist() == [0, 4, 4, 4, 3, 3, 3, 3]
  assert zero_colour_pixels(usage.draw(str(tmp_path), str(tmp_path / "dead.png"))) > 100


def balanced_pixels(path) -> int:
  """Pixels of the picture in BALANCED_COLOUR (the device load panel's line at 1)."""
  from matplotlib import colors, image

  rgb = (image.imread(path)[..., :3] * 255).round().astype(int)
  want = (np.array(colors.to_rgb(usage.BALANCED_COLOUR)) * 255).round().astype(int)
  return int((np.abs(rgb - want).max(-1) <= 2).sum())


def test_the_device_load_panel_draws_each_layer_and_its_split(tmp_path):
  """A MoE run's device_load per window, each layer labelled with the devices its experts are split over, and the
  balanced line at 1 (over a layer's own line at 1); a run that logged none says so in its panel instead."""
  config = micro_config("moe")
  config.model.ffn.update(n_experts=8)
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
  base = {"usage/layers_0/dead": 0.0, "usage/layers_0/kl_uniform": 0.1, "usage/layers_1/dead": 0.0}
  old = [dict(base, step=s) for s in (10, 20)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in old))
  np.savez(tmp_path / "usage_last_window.npz", step=20, layers_0=np.arange(8.0), layers_1=np.ones(8))
  assert balanced_pixels(usage.draw(str(tmp_path), str(tmp_path / "old.png"))) == 0

  loads = {10: (1.8, 1.0), 20: (1.4, 1.0)}
  rows = [
    dict(base, step=s, **{"usage/layers_0/device_load": a, "usage/layers_1/device_load": b})
    | {"usage/layers_0/load_devices": 2.0, "usage/layers_1/load_devices": 1.0}
    for s, (a, b) in loads.items()
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
  series = usage.windows(str(tmp_path))
  assert series["layers_0"]["device_load"] == [(10, 1.8), (20, 1.4)]
  assert usage.load_label(series["layers_0"], "layers_0", "device_load") == "layers_0 (2 devices)"
  assert usage.load_label(series["layers_1"], "layers_1", "device_load") == "layers_1 (1 device)"
  assert usage.load_label(series["layers_0"], "layers_0", "dead") == "layers_0"
  assert balanced_pixels(usage.draw(str(tmp_path), str(tmp_path / "load.png"))) > 200
