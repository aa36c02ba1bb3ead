"""sparsetx.tools.circuits end to end on a tiny trained sgatlin checkpoint and on a mixed (partly sparsified) one:
tables, database and PNGs."""

import json
import os

import numpy as np
import pytest
from absl import flags
from conftest import load_config
from test_train import micro_config

from sparsetx import cli, sparsify
from sparsetx.interp.circuits import CircuitDatabase
from sparsetx.parallel import mesh as mesh_lib
from sparsetx.tools import circuits as circuits_tool
from sparsetx.train import state as state_lib
from sparsetx.train.run import loop

PNG = b"\x89PNG\r\n\x1a\n"


def run_tool(argv: list[str]) -> int:
  """`python -m sparsetx.tools.circuits ARGV`'s exit code, in this process (its flags in a FlagValues of their own)."""
  values = flags.FlagValues()
  holders = circuits_tool.define_flags(values)
  return circuits_tool.absl_main(cli.parse_flags(["circuits", *argv], values), holders)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A micro sgatlin model trained for 20 steps on the facts task (small validation split: fast). The
  model and train settings are tests/test_train.py's micro ones, so the step program is shared through
  the session's compilation cache when both run."""
  config = load_config("configs/tiny.py", "sgatlin")
  config.model.update(d_model=64, n_layers=2, max_len=32, dtype="float32")
  config.data.update(mixture=(("facts", 1.0),), seq_len=32, global_batch_size=8, eval_batch_size=8, shuffle_buffer=64)
  config.train.update(steps=20, warmup_steps=5, log_every=1, eval_every=1000, eval_batches=1)
  config.checkpoint.update(every=20)
  path = str(tmp_path_factory.mktemp("interp_tool"))
  loop.train(config, path)
  return path


def test_circuits_tool_writes_tables_database_and_pngs(workdir, tmp_path):
  out = tmp_path / "circuits"
  code = run_tool(
    [
      f"--workdir={workdir}",
      f"--output={out}",
      "--rows=24",
      "--neighbours=3",
      "--embed_tokens=6",
      "--per_token=10",
      "--min_effect=0",
    ]
  )
  assert code == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["step"] == 20 and summary["ffn_type"] == "sgatlin"
  assert sorted(summary["files"]) == sorted(os.listdir(out))
  for name in ("nie.png", "embedding_layer0.png", "embedding_layer1.png"):
    assert (out / name).read_bytes()[:8] == PNG
  db = CircuitDatabase.load(str(out / "circuits.npz"))
  assert len(db) == summary["database_tokens"] > 0 and db.ffn_type == "sgatlin"
  assert db.ids_LNS.shape == (2, len(db), 4 * 8) and 0 <= db.ids_LNS.min() and db.ids_LNS.max() < 4 * 1024
  nie_values = np.array(summary["nie"]["values"], dtype=float)
  assert nie_values.shape == (3, 5) and summary["nie"]["rows"] == ["0", "1", "all"]
  assert np.isfinite(nie_values).all() and summary["nie"]["kept_pairs"] > 0
  table = (out / "nie.md").read_text().splitlines()
  assert table[2].startswith("| layer | noun_first | noun_last | was | last | all |") and len(table) >= 8
  assert [row["layer"] for row in summary["usage"]] == [0, 1]
  assert all(0 < row["used"] <= 1 and 0 <= row["gini"] < 1 for row in summary["usage"])
  neighbours = (out / "neighbours.md").read_text()
  assert "| rank | <s> | A | ␣ | b | i | g |" in neighbours and "\n| 3 |" in neighbours
  assert "(mlp): Sgatlin" in (out / "model.txt").read_text()


def test_circuits_tool_refuses_a_workdir_without_checkpoints(tmp_path, capsys):
  assert run_tool([f"--workdir={tmp_path}"]) == 2
  assert "holds no checkpoints/ directory" in capsys.readouterr().err
  assert not (tmp_path / "checkpoints").exists()


@pytest.fixture(scope="module")
def mixed_workdir(tmp_path_factory):
  """What sparsetx.tools.sparsify writes for a micro dense MLP with ffn_layers=1: step 0, layer 0 the source's MLP,
  layer 1 a fresh sgatlin (untrained: no train step to compile; tests/test_sparsify.py's configs, so the
  init programs are shared through the compilation cache)."""
  source = micro_config("mlp")
  mesh = mesh_lib.make_mesh(source.mesh)
  _, shardings, model, tx = state_lib.state_shardings(source, mesh)
  params = state_lib.create_state(source, shardings, model, tx).params
  target = micro_config("sgatlin")
  target.model.ffn_layers = "1"
  target.data.mixture = (("facts", 1.0),)  # a small validation split
  path = str(tmp_path_factory.mktemp("interp_mixed") / "run")
  sparsify.sparsify_params(source, params, target, path, mesh)
  return path


def test_circuits_tool_on_a_mixed_model_refuses_a_dense_layer_and_analyses_the_sparse_one(
  mixed_workdir, tmp_path, capsys
):
  refused = tmp_path / "refused"
  assert run_tool([f"--workdir={mixed_workdir}", f"--output={refused}", "--layer=0"]) == 2
  assert capsys.readouterr().err.strip() == (
    "error: --layer=0 is a dense layer ('mlp', config.model.dense_ffn) of this mixed model and has no sparse "
    "circuit; use one of its sgatlin layers: 1."
  )
  assert not refused.exists()  # refused before anything is written

  out = tmp_path / "circuits"
  code = run_tool(
    [
      f"--workdir={mixed_workdir}",
      f"--output={out}",
      "--rows=8",
      "--neighbours=3",
      "--embed_tokens=4",
      "--per_token=5",
      "--min_effect=0",
    ]
  )
  assert code == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["step"] == 0 and summary["sparse_layers"] == [1]
  assert sorted(summary["files"]) == sorted(os.listdir(out)) and "embedding_layer0.png" not in summary["files"]
  assert (out / "embedding_layer1.png").read_bytes()[:8] == PNG
  db = CircuitDatabase.load(str(out / "circuits.npz"))
  assert db.layers_L.tolist() == [1] and db.ids_LNS.shape == (1, len(db), 4 * 8) and db.ids_LNS.max() < 4 * 1024
  assert [row["layer"] for row in summary["usage"]] == [1] and summary["nie"]["rows"] == ["1", "all"]
  assert np.array(summary["nie"]["values"], dtype=float).shape == (2, 5)
  assert "# Nearest circuits at layer 1 " in (out / "neighbours.md").read_text()
  printout = (out / "model.txt").read_text()
  assert "ffn=sgatlin in layers 1, mlp in the others" in printout
  assert "(0): Block(" in printout and "(mlp): Mlp(" in printout and "(1): Block(" in printout
