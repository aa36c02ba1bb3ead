"""Sparse fine-tuning from a dense checkpoint (sparsetx/tools/sparsify.py): copies, fresh layers, report, resume, freeze."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO
from test_train import finish, losses, micro_config, one_step, run_cli

from sparsetx import config as config_lib
from sparsetx import sparsify
from sparsetx.models import ladder
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.train import state as state_lib
from sparsetx.train.checkpoints import checkpointing
from sparsetx.train.run import loop


@pytest.fixture(scope="module")
def dense_workdir(tmp_path_factory):
  """The micro dense (GELU MLP) model trained 10 steps: the source of every test here."""
  workdir = str(tmp_path_factory.mktemp("dense") / "run")
  loop.train(micro_config("mlp", steps=10), workdir)
  return workdir


@pytest.fixture(scope="module")
def mesh():
  return mesh_lib.make_mesh(micro_config("fff").mesh)


def flat(params) -> dict:
  return {sparsify._path_name(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def read_params(workdir, config, mesh, step):
  abstract, _, _, _ = state_lib.state_shardings(config, mesh)
  checkpointer = checkpointing.Checkpointer(workdir, config.checkpoint)
  try:
    return flat(checkpointer.restore_params(step, abstract.params))
  finally:
    checkpointer.close()


def test_fff_swap_copies_bit_identical_and_starts_fresh(dense_workdir, mesh, tmp_path):
  target = str(tmp_path / "fff")
  config, report = sparsify.sparsify_checkpoint(dense_workdir, micro_config("fff"), target)
  source_config, source_params = sparsify.load_checkpoint(dense_workdir, mesh)
  source, written = flat(source_params), read_params(target, config, mesh, 0)

  copied = [name for name in written if "/mlp/" not in name]
  assert sorted(copied) == report["copied"]["names"]
  for name in copied:  # attention, norms, embeddings, head: the source's bits
    np.testing.assert_array_equal(written[name], source[name], err_msg=name)
  # The new layers: FFF shapes of the config, values of the layer's own init in a fresh model (seed train.seed).
  P, D, N = config.model.ffn.n_trees, config.model.d_model, 2 ** (config.model.ffn.depth + 1) - 1
  _, shardings, model, tx = state_lib.state_shardings(config, mesh)
  fresh = flat(state_lib.create_state(config, shardings, model, tx).params)
  for i in range(config.model.n_layers):
    prefix = f"layers_{i}/mlp/"
    assert {n[len(prefix) :]: written[n].shape for n in written if n.startswith(prefix)} == dict(
      w_in=(P, N, D), b_in=(P, N), w_out=(P, N, D), b_out=(D,)
    )
    assert np.abs(written[prefix + "w_in"]).max() <= D**-0.5 and np.abs(written[prefix + "b_in"]).max() <= D**-0.5
    assert np.abs(written[prefix + "w_out"]).max() <= ((config.model.ffn.depth + 1) * P) ** -0.5
    for name in ("w_in", "b_in", "w_out", "b_out"):
      np.testing.assert_array_equal(written[prefix + name], fresh[prefix + name])

  total = sum(leaf.size for leaf in written.values())
  assert report["copied"]["parameters"] + report["new"]["parameters"] == report["total"] == total
  assert total == ladder.param_counts(config.model)["total"]
  assert report["dropped"]["names"] == sorted(n for n in source if "/mlp/" in n)
  assert report["dropped"]["parameters"] == sum(source[n].size for n in report["dropped"]["names"])
  with open(os.path.join(target, sparsify.REPORT_FILE)) as f:
    assert json.load(f) == report


def test_layer_list_swaps_only_those(dense_workdir, mesh, tmp_path):
  wanted = micro_config("sgatlin")
  wanted.model.ffn_layers = "1"
  config, report = sparsify.sparsify_checkpoint(dense_workdir, wanted, str(tmp_path / "mixed"))
  assert report["swapped_layers"] == [1] and config_lib.is_mixed(config.model)
  source_config, source_params = sparsify.load_checkpoint(dense_workdir, mesh)
  assert config.model.dense_ffn.to_dict() == source_config.model.ffn.to_dict()  # layer 0 keeps the source's MLP
  source, written = flat(source_params), read_params(str(tmp_path / "mixed"), config, mesh, 0)
  for name in ("layers_0/mlp/wi/kernel", "layers_0/mlp/wo/kernel"):
    np.testing.assert_array_equal(written[name], source[name])
  new_sizes = [v.size for n, v in written.items() if n.startswith("layers_1/mlp/")]
  assert report["new"]["groups"] == {"layers_1/mlp": sum(new_sizes)}
  assert written["layers_1/mlp/experts"].shape == (2, 4, 32**2, 64)
  assert report["dropped"]["names"] == ["layers_1/mlp/wi/kernel", "layers_1/mlp/wo/kernel"]  # micro model: no biases


def test_hf_source_copies_bit_identical(dense_workdir, mesh, tmp_path):
  """The dense model exported to the HF layout (hf/export) and sparsified from there: the same copies."""
  from sparsetx.hf import export

  source_config, source_params = sparsify.load_checkpoint(dense_workdir, mesh)
  export.write_hf(source_config, jax.device_get(source_params), str(tmp_path / "hf"))
  previous = tmp_path / "fff"  # a finished run there, replaced on request
  (previous / "checkpoints" / "40").mkdir(parents=True)
  (previous / "metrics.jsonl").write_text("{}\n")
  config, report = sparsify.sparsify_hf(str(tmp_path / "hf"), micro_config("fff"), str(previous), overwrite=True)
  assert not (previous / "metrics.jsonl").exists() and os.listdir(previous / "checkpoints") == ["0"]
  source, written = flat(source_params), read_params(str(previous), config, mesh, 0)
  assert report["copied"]["names"] == sorted(n for n in written if "/mlp/" not in n)
  for name in report["copied"]["names"]:
    np.testing.assert_array_equal(written[name], source[name], err_msg=name)


@pytest.mark.parametrize(
  "field,value", [("d_model", 128), ("vocab_size", 1024), ("n_layers", 3), ("head_dim", 32), ("block", "parallel")]
)
def test_other_shapes_refused(dense_workdir, tmp_path, field, value):
  wanted = micro_config("fff")
  wanted.model[field] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.model\.{field}=.* but the source model has"):
    sparsify.sparsify_checkpoint(dense_workdir, wanted, str(tmp_path / "x"))
  assert not os.path.exists(tmp_path / "x" / "checkpoints")


def test_bad_paths_refused(dense_workdir, tmp_path):
  with pytest.raises(config_lib.ConfigError, match="holds no checkpoints/ directory"):
    sparsify.sparsify_checkpoint(str(tmp_path / "missing"), micro_config("fff"), str(tmp_path / "y"))
  occupied = tmp_path / "occupied"
  (occupied / "checkpoints").mkdir(parents=True)
  (occupied / "metrics.jsonl").write_text("{}\n")
  with pytest.raises(config_lib.ConfigError, match="already holds checkpoints, metrics.jsonl; .* --overwrite"):
    sparsify.sparsify_checkpoint(dense_workdir, micro_config("fff"), str(occupied))
  assert (occupied / "metrics.jsonl").read_text() == "{}\n"  # nothing saved is touched
  with pytest.raises(config_lib.ConfigError, match="is the source itself"):
    sparsify.sparsify_checkpoint(dense_workdir, micro_config("fff"), dense_workdir, overwrite=True)


@pytest.mark.parametrize("layers,match", [("2", "outside the 2 layers"), ("0,0", "twice"), ("a", "comma-separated")])
def test_ffn_layers_validated(layers, match):
  config = micro_config("fff")
  config.model.ffn_layers = layers
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(config)


@pytest.mark.long  # a system case of half a minute or more: make test-long
def test_tool_then_trainer_resumes_at_step_0_and_freezes(dense_workdir, mesh, tmp_path):
  """python -m sparsetx.tools.sparsify writes the start, `python -m sparsetx.train` trains it on; copied params are frozen
  for freeze_steps=10, then move; the loss falls."""
  target = str(tmp_path / "ft")
  overrides = [
    "--config.model.d_model=64",
    "--config.model.n_layers=2",
    "--config.model.max_len=32",
    "--config.model.dtype=float32",
    "--config.data.seq_len=32",
  ]
  tool = subprocess.run(
    [
      sys.executable,
      "-m",
      "sparsetx.tools.sparsify",
      f"--source={dense_workdir}",
      f"--workdir={target}",
      "--config=configs/tiny.py:fff",
      *overrides,
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert tool.returncode == 0, tool.stderr[-3000:]
  assert "copied" in tool.stdout and "new" in tool.stdout
  process = run_cli(target, "--config.train.freeze_steps=10", ffn_type="fff")
  output = finish(process, timeout=300)
  assert process.returncode == 0, output[-3000:]
  got = losses(target)
  assert sorted(got) == list(range(1, 21))  # started at step 0
  assert got[20] < got[1] - 0.3, got

  config = micro_config("fff")
  source = flat(sparsify.load_checkpoint(dense_workdir, mesh)[1])
  at_10, at_15 = read_params(target, config, mesh, 10), read_params(target, config, mesh, 15)
  for name, value in at_10.items():
    if "/mlp/" in name:
      assert not np.array_equal(value, at_15[name]), name
    else:
      np.testing.assert_array_equal(value, source[name], err_msg=name)  # frozen through step 10
      assert not np.array_equal(at_15[name], source[name]), name  # trained after


def test_partly_sparsified_model_trains_with_per_layer_stats(mesh):
  """A mixed model (FFF in layer 1, the dense MLP kept in layer 0) takes a sharded train step; the sparse
  statistics read each layer's own feed-forward type, and the ladder counts each layer's own parameters."""
  config = micro_config("fff")
  config.model.ffn_layers = "1"
  config.model.dense_ffn.update(type="mlp", d_ffw=128)
  params, metrics, _ = one_step(config, mesh)
  assert np.isfinite(metrics["loss"])
  fff_stats = (
    "used",
    "gini",
    "gini_level_1",
    "gini_level_2",
    "gini_level_3",
    "gini_level_4",
    "leftmost_leaf_share",
    "left_turns",
    "path_entropy",
  )  # depth 4
  assert {k for k in metrics if k.startswith("sparse/")} == {f"sparse/layers_1/{name}" for name in fff_stats}
  assert sum(np.size(v) for v in jax.tree.leaves(params)) == ladder.param_counts(config.model)["total"]
