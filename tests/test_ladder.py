"""The scaling ladder: Listing 2, parameter counts against the built models, FLOPs by hand."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from conftest import REPO, load_config

from sparsetx import config as config_lib
from sparsetx.models import ladder
from sparsetx.models.transformer import Transformer


def listing_2(scale, feedforward_type):
  """The sgatlin paper's Listing 2, transcribed."""
  d_model = 128 * scale
  n_layers = 2 * scale
  match feedforward_type:
    case "swiglu" | "mlp":
      d_ffw = int(8 / 3 * d_model / 256) * 256
    case "moe":
      d_ffw = d_model
    case "peer":
      d_ffw = (32 + 24 * scale) ** 2
    case "sgatlin":
      d_ffw = (16 + 12 * scale) ** 2
  return (d_model, n_layers, d_ffw)


@pytest.mark.parametrize("scale", range(2, 9))
def test_ladder_reproduces_listing_2(scale):
  for ffn_type in ("mlp", "swiglu", "moe", "peer", "sgatlin"):
    assert ladder.scaling_ladder(scale, ffn_type) == listing_2(scale, ffn_type)
    config = ladder.ladder_model_config(scale, ffn_type)
    assert (config.d_model, config.n_layers, config.ffn.d_ffw) == listing_2(scale, ffn_type)
    assert config.d_model // config.head_dim == 2 * scale  # heads of 64


@pytest.mark.parametrize("ffn_type", config_lib.FFN_TYPES)
def test_parameter_count_equals_built_model(ffn_type):
  for scale in ladder.SCALES:
    config = config_lib.default_config()
    config.model = ladder.ladder_model_config(scale, ffn_type)
    config.data.seq_len = config.model.max_len
    config_lib.validate(config)
    model = Transformer(ml_collections.FrozenConfigDict(config.model))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    built = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    assert built == ladder.param_counts(config.model)["total"], (ffn_type, scale)


def test_parameter_count_of_pythia_shape_equals_built_model():
  config = load_config("configs/pythia.py")
  model = Transformer(ml_collections.FrozenConfigDict(config.model))
  shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
  built = sum(leaf.size for leaf in jax.tree.leaves(shapes))
  assert built == ladder.param_counts(config.model)["total"] == 70_426_624  # Pythia-70M's published count


def hand_config(ffn_type, **ffn):
  """D=64, 2 layers, one head of 64, vocabulary 100, context 16."""
  model = config_lib.model_defaults()
  model.update(d_model=64, n_layers=2, head_dim=64, vocab_size=100, max_len=16)
  model.ffn.type = ffn_type
  model.ffn.update(ffn)
  return model


# Per layer attention: 2 * (4 * 64 * 64 + 2 * 16 * 64) = 36_864; head: 2 * 64 * 100 = 12_800.
HAND_COUNTS = [
  ("mlp", dict(d_ffw=128), 2 * 2 * 64 * 128),  # 32_768
  ("swiglu", dict(d_ffw=128), 2 * 3 * 64 * 128),  # 49_152
  ("moe", dict(d_ffw=32, n_experts=4, experts_per_token=2), 2 * (64 * 4 + 2 * 3 * 64 * 32)),  # 25_088
  # peer: per channel a query 64 -> 8 and two half-queries of 4 against 16 sub-keys each, then k=4 neurons.
  ("peer", dict(d_ffw=256, n_channels=2, top_k=4, d_key=8), 2 * (2 * (64 * 8 + 2 * 16 * 4) + 2 * 4 * 2 * 64)),
  # sgatlin: one query 64 -> 8, per channel 2 * 16 key scores of 8, then k=4 neurons of in and out.
  ("sgatlin", dict(d_ffw=256, n_channels=2, top_k=4, d_key=8), 2 * (64 * 8 + 2 * 2 * 16 * 8 + 2 * 4 * 2 * 64)),
  # fff: 3 trees, depth 2 -> 3 nodes on a path, each one dot and one axpy of 64.
  ("fff", dict(n_trees=3, depth=2), 2 * 3 * 3 * 2 * 64),
]


@pytest.mark.parametrize("ffn_type, ffn, ffn_flops", HAND_COUNTS)
def test_flops_per_token_equal_hand_count(ffn_type, ffn, ffn_flops):
  flops = ladder.forward_flops_per_token(hand_config(ffn_type, **ffn))
  assert flops["ffn"] == 2 * ffn_flops
  assert flops["total"] == 2 * (36_864 + ffn_flops) + 12_800
  assert ladder.training_tokens(hand_config(ffn_type, **ffn), 3e9) == int(3e9 // (3 * flops["total"]))


def test_sparse_layers_are_mostly_inactive():
  sgatlin = ladder.param_counts(ladder.ladder_model_config(8, "sgatlin"))
  # Neurons: k / d_ffw = 8 / 12544 < 0.1% (the paper's figure); the router's parameters are all active.
  router = 1024 * 128 + 128 * 2 * 16 * 112  # shared query, per-channel keys over 2 x sqrt(12544)
  assert sgatlin["ffn_active"] == 16 * (router + 16 * 8 * 2 * 1024)
  assert sgatlin["ffn_total"] == 16 * (router + 2 * 16 * 12544 * 1024)
  fff = ladder.param_counts(ladder.ladder_model_config(6, "fff"))
  assert fff["ffn_active"] / fff["ffn_total"] == pytest.approx(7 / 127, rel=1e-2)


def test_ladder_program_prints_every_rung():
  result = subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.ladder", "--budget=6e18"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.strip().splitlines()
  assert len(lines) == 2 + len(config_lib.FFN_TYPES) * len(ladder.SCALES)
  assert "tokens @ 6e+18" in lines[0]


def test_ladder_config_file_and_bad_argument():
  assert load_config("configs/ladder.py", "sgatlin,4").model.ffn.d_ffw == 64**2
  with pytest.raises(config_lib.ConfigError, match=r"must be 'FFN,SCALE\[,TARGET\]'"):
    load_config("configs/ladder.py", "sgatlin")
  with pytest.raises(config_lib.ConfigError, match="unknown"):
    load_config("configs/ladder.py", "dense,4")
