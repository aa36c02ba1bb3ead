"""tools/sweep.py end to end: a tiny isoflop sweep (mlp, sgatlin x d_model 32, 64) trained, collected and plotted."""

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys

import matplotlib.image
import pytest
from absl import flags
from conftest import REPO, load_config
from ml_collections import config_flags

from sparsetx.models import ladder
from sparsetx.train import sweep

BUDGET = 2e9  # 7 to 19 steps of 256 tokens per run
# tests/test_train.py's micro settings (head_dim 32 so d_model 32 fits), facts only: one small validation split.
MICRO = (
    "config.model.head_dim=32", "config.model.n_layers=2", "config.model.max_len=32", "config.model.dtype=float32",
    "config.data.seq_len=32", "config.data.global_batch_size=8", "config.data.eval_batch_size=8",
    "config.data.shuffle_buffer=64", 'config.data.mixture=(("facts",1.0),)', "config.train.warmup_steps=2",
    "config.train.log_every=1", "config.train.eval_batches=1", "config.checkpoint.every=1000",
)


def load_tool():
  spec = importlib.util.spec_from_file_location("sweep_tool", REPO / "tools" / "sweep.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tiny_spec(workdir, **changes) -> sweep.SweepSpec:
  fields = dict(budgets=(BUDGET,), ffn_types=("mlp", "sgatlin"), workdir=str(workdir), base_config="configs/tiny.py",
                d_models=(32, 64), overrides=MICRO, min_steps=2)
  return sweep.SweepSpec(**{**fields, **changes})


def cli_flags(spec: sweep.SweepSpec) -> list[str]:
  return ([f"--budgets={','.join(map(str, spec.budgets))}", f"--ffn_types={','.join(spec.ffn_types)}",
           f"--base_config={spec.base_config}", f"--d_models={','.join(map(str, spec.d_models))}",
           f"--workdir={spec.workdir}", f"--min_steps={spec.min_steps}"] + [f"--overrides={o}" for o in spec.overrides])


def run_cli(*args):
  return subprocess.run([sys.executable, "tools/sweep.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def trainer_config(command: str):
  """The config `python -m sparsetx.train` builds from a printed command (its own flag definitions)."""
  argv = shlex.split(command)
  assert argv[:3] == ["python", "-m", "sparsetx.train"], command
  argv = ["sparsetx.train", *argv[3:]]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True, sys_argv=argv)
  workdir = flags.DEFINE_string("workdir", None, "", flag_values=values)
  values(argv)
  return holder.value, workdir.value


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
  """The sweep trained in this process (the CLI's run mode without its flag parsing)."""
  root = tmp_path_factory.mktemp("sweep")
  cwd = os.getcwd()
  os.chdir(REPO)  # --base_config is relative to the repository, as the printed commands are
  try:
    rows = load_tool().run_sweep(tiny_spec(root), "run")
  finally:
    os.chdir(cwd)
  return root, rows


def test_sweep_trains_the_budgets_steps_and_collects_each_final_eval(finished_sweep):
  root, rows = finished_sweep
  assert [(r["ffn_type"], r["d_model"]) for r in rows] == [("mlp", 32), ("mlp", 64), ("sgatlin", 32), ("sgatlin", 64)]
  for row in rows:
    config = load_config("configs/tiny.py", row["ffn_type"])
    config.model.update(d_model=row["d_model"], n_layers=2, head_dim=32)
    forward = ladder.forward_flops_per_token(config.model, 32)["total"]
    tokens = int(BUDGET // (3 * forward))
    assert (row["forward_flops_per_token"], row["tokens"]) == (forward, tokens)
    assert row["steps"] == math.ceil(tokens / (8 * 32)) >= 2
    assert BUDGET <= row["flops"] < BUDGET + 3 * forward * 8 * 32  # at most one step beyond the budget
    params = ladder.param_counts(config.model)
    assert (row["total_params"], row["active_params"]) == (params["total"], params["active"])

    history = metrics(row["workdir"])
    assert sorted(r["step"] for r in history if "loss" in r) == list(range(1, row["steps"] + 1))  # trained exactly
    last_eval = [r for r in history if "eval/facts/loss" in r][-1]
    assert last_eval["step"] == row["steps"] == row["step"]
    assert row["tasks"] == {"facts": dict(loss=last_eval["eval/facts/loss"], perplexity=last_eval["eval/facts/perplexity"])}
    assert row["perplexity"] == pytest.approx(math.exp(last_eval["eval/facts/loss"]), rel=1e-12)
    assert 1.0 < row["perplexity"] < config.model.vocab_size  # finite, better than a uniform guess over the vocabulary
  assert rows[2]["active_params"] < rows[2]["total_params"]  # sgatlin: sparse

  with open(root / "sweep.json") as f:
    saved = json.load(f)
  assert saved["runs"] == json.loads(json.dumps(rows)) and saved["skipped"] == []
  for name in ("isoflop_perplexity_vs_size.png", "best_perplexity_vs_compute.png"):
    image = matplotlib.image.imread(root / name)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200 and image.shape[2] in (3, 4), name


def test_finished_runs_are_collected_not_rerun(finished_sweep, monkeypatch):
  root, rows = finished_sweep
  tool = load_tool()
  monkeypatch.setattr(tool, "train", lambda *a: pytest.fail("a finished run was trained again"))
  monkeypatch.chdir(REPO)
  before = {r["name"]: os.path.getmtime(os.path.join(r["workdir"], "metrics.jsonl")) for r in rows}
  assert tool.run_sweep(tiny_spec(root), "run") == rows
  assert {r["name"]: os.path.getmtime(os.path.join(r["workdir"], "metrics.jsonl")) for r in rows} == before

  # The CLI's collect mode (as after a cluster sweep) reads the same rows and rewrites the plots.
  os.remove(root / "best_perplexity_vs_compute.png")
  result = run_cli(*cli_flags(tiny_spec(root)), "--mode=collect")
  assert result.returncode == 0, result.stderr[-2000:]
  with open(root / "sweep.json") as f:
    assert json.load(f)["runs"] == json.loads(json.dumps(rows))
  assert matplotlib.image.imread(root / "best_perplexity_vs_compute.png").ndim == 3


def test_print_mode_prints_one_parsable_command_per_run(finished_sweep):
  root, rows = finished_sweep
  result = run_cli(*cli_flags(tiny_spec(root)), "--mode=print")
  assert result.returncode == 0, result.stderr[-2000:]
  commands = result.stdout.strip().splitlines()
  assert commands == [r["command"] for r in rows]
  for command, row in zip(commands, rows):
    config, workdir = trainer_config(command)
    assert (config.model.ffn.type, config.model.d_model, config.train.steps) == (row["ffn_type"], row["d_model"], row["steps"])
    assert config.data.mixture == (("facts", 1.0),) and workdir == row["workdir"]


@pytest.mark.parametrize(
    "flag, message",
    [("--ffn_types=mlp,dense", "--ffn_types holds 'dense', an unknown feed-forward type"),
     ("--budgets=0", "--budgets holds 0.0; every FLOP budget must be a positive number"),
     ("--budgets=-1e9", "--budgets holds -1000000000.0; every FLOP budget must be a positive number"),
     ("--overrides=config.train.steps=5", "sets config.train.steps, which the sweep derives from the FLOP budget")],
)
def test_bad_input_is_one_clear_error(tmp_path, flag, message):
  result = run_cli(*cli_flags(tiny_spec(tmp_path / "never")), "--mode=print", flag)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr, result.stderr
  assert result.stdout == "" and not (tmp_path / "never").exists()


def test_a_budget_too_small_for_every_run_is_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  runs, skipped = sweep.plan(tiny_spec(tmp_path, budgets=(1e8,)))
  assert runs == [] and len(skipped) == 4 and "fewer than" in skipped[0].reason
  with pytest.raises(sweep.config_lib.ConfigError, match="too short to train"):
    load_tool().run_sweep(tiny_spec(tmp_path, budgets=(1e8,)), "print")


def test_a_run_dir_evaluated_at_another_step_count_is_refused_and_a_partial_one_resumes(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  run = sweep.plan(tiny_spec(tmp_path))[0][0]
  os.makedirs(run.workdir)
  path = os.path.join(run.workdir, "metrics.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"step": run.steps - 1, "eval/facts/loss": 5.0, "eval/facts/perplexity": math.exp(5.0)}) + "\n")
    f.write('{"step": ')  # a line cut short by a killed trainer
  assert sweep.final_eval(run) is None  # unfinished: the sweep trains it (the trainer resumes its checkpoint)
  with open(path, "w") as f:
    f.write(json.dumps({"step": run.steps + 5, "eval/facts/loss": 5.0, "eval/facts/perplexity": math.exp(5.0)}) + "\n")
  with pytest.raises(sweep.config_lib.ConfigError, match=f"evaluated at step {run.steps + 5}, but this sweep plans"):
    sweep.final_eval(run)
