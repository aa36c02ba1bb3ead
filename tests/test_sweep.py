"""sparsetx.tools.sweep end to end: README's CPU isoflop sweep (mlp, sgatlin x d_model 32, 64) run as written,
collected and plotted; every type sized from d_model as the ladder does."""

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

from sparsetx.measure import sweep
from sparsetx.models import ladder
from sparsetx.tools import sweep as sweep_tool

BUDGET = 3e9  # 18 to 53 steps of 256 tokens per run
# The feed-forward widths the ladder's rules give, by hand: mlp 8/3 d rounded down to a multiple of 256, or of
# d below d=96 (2 d); sgatlin (16 + 12 d/128)**2 -> 19**2, 22**2.
WIDTHS = {("mlp", 32): 64, ("mlp", 64): 128, ("sgatlin", 32): 19**2, ("sgatlin", 64): 22**2}


def readme_sweep_command() -> list[str]:
  """The CPU sweep command README.md shows, as argv (its continuation lines joined, its comment dropped)."""
  text = (REPO / "README.md").read_text().replace("\\\n", " ")
  (line,) = [
    line
    for line in text.splitlines()
    if line.startswith(".venv/bin/python -m sparsetx.tools.sweep") and "--d_models" in line
  ]
  return shlex.split(line, comments=True)


def tiny_spec(workdir, **changes) -> sweep.SweepSpec:
  """README's sweep (readme_sweep_command) as a SweepSpec."""
  fields = dict(
    budgets=(BUDGET,),
    ffn_types=("mlp", "sgatlin"),
    workdir=str(workdir),
    base_config="configs/sweep_cpu.py",
    d_models=(32, 64),
  )
  return sweep.SweepSpec(**{**fields, **changes})


def cli_flags(spec: sweep.SweepSpec) -> list[str]:
  return [
    f"--budgets={','.join(map(str, spec.budgets))}",
    f"--ffn_types={','.join(spec.ffn_types)}",
    f"--base_config={spec.base_config}",
    f"--d_models={','.join(map(str, spec.d_models))}",
    f"--workdir={spec.workdir}",
    f"--min_steps={spec.min_steps}",
  ] + [f"--overrides={o}" for o in spec.overrides]


def run_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "sparsetx.tools.sweep", *args], cwd=REPO, capture_output=True, text=True, timeout=120
  )


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
  """README's sweep command, run as written but for its --workdir."""
  root = tmp_path_factory.mktemp("sweep")
  argv = readme_sweep_command()
  assert argv[:3] == [".venv/bin/python", "-m", "sparsetx.tools.sweep"] and argv[-1] == "--workdir=/tmp/sweep"
  given = dict(arg.removeprefix("--").split("=", 1) for arg in argv[3:-1])  # what tiny_spec holds
  assert given == dict(budgets="3e9", ffn_types="mlp,sgatlin", base_config="configs/sweep_cpu.py", d_models="32,64")
  argv = [sys.executable, *argv[1:-1], f"--workdir={root}"]
  result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(root / "sweep.json") as f:
    rows = json.load(f)["runs"]
  table = result.stdout.splitlines()
  assert "FLOPs/token" in table[0] and len(table) == 1 + len(rows)
  for line, row in zip(table[1:], rows):  # each result printed next to the FLOPs per token it paid
    assert line.split()[1:5] == [
      row["name"],
      f"{row['total_params']:,}",
      f"{row['active_params']:,}",
      f"{row['forward_flops_per_token']:,}",
    ]
  return root, rows


@pytest.mark.long
def test_sweep_trains_the_budgets_steps_and_collects_each_final_eval(finished_sweep):
  root, rows = finished_sweep
  assert [(r["ffn_type"], r["d_model"]) for r in rows] == [("mlp", 32), ("mlp", 64), ("sgatlin", 32), ("sgatlin", 64)]
  for row in rows:
    config = load_config("configs/sweep_cpu.py", row["ffn_type"])
    config.model.update(d_model=row["d_model"])
    config.model.ffn.d_ffw = WIDTHS[row["ffn_type"], row["d_model"]]
    forward = ladder.forward_flops_per_token(config.model, 32)["total"]
    tokens = int(BUDGET // (3 * forward))
    assert (row["forward_flops_per_token"], row["tokens"]) == (forward, tokens)
    assert row["steps"] == math.ceil(tokens / (8 * 32)) >= 10
    assert BUDGET <= row["flops"] < BUDGET + 3 * forward * 8 * 32  # at most one step beyond the budget
    params = ladder.param_counts(config.model)
    assert (row["total_params"], row["active_params"]) == (params["total"], params["active"])

    history = metrics(row["workdir"])
    assert sorted(r["step"] for r in history if "loss" in r) == list(range(1, row["steps"] + 1))  # trained exactly
    last_eval = [r for r in history if "eval/facts/loss" in r][-1]
    assert last_eval["step"] == row["steps"] == row["step"]
    assert row["tasks"] == {
      "facts": dict(loss=last_eval["eval/facts/loss"], perplexity=last_eval["eval/facts/perplexity"])
    }
    assert row["perplexity"] == pytest.approx(math.exp(last_eval["eval/facts/loss"]), rel=1e-12)
    assert 1.0 < row["perplexity"] < config.model.vocab_size  # finite, better than a uniform guess over the vocabulary
  assert rows[2]["active_params"] < rows[2]["total_params"]  # sgatlin: sparse

  with open(root / "sweep.json") as f:
    saved = json.load(f)
  assert saved["runs"] == json.loads(json.dumps(rows)) and saved["skipped"] == []
  for name in ("isoflop_perplexity_vs_size.png", "best_perplexity_vs_compute.png"):
    image = matplotlib.image.imread(root / name)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200 and image.shape[2] in (3, 4), name


@pytest.mark.long
def test_finished_runs_are_collected_not_rerun(finished_sweep, monkeypatch):
  root, rows = finished_sweep
  monkeypatch.setattr(sweep_tool, "train", lambda *a: pytest.fail("a finished run was trained again"))
  monkeypatch.chdir(REPO)
  before = {r["name"]: os.path.getmtime(os.path.join(r["workdir"], "metrics.jsonl")) for r in rows}
  assert sweep_tool.run_sweep(tiny_spec(root), "run") == rows
  assert {r["name"]: os.path.getmtime(os.path.join(r["workdir"], "metrics.jsonl")) for r in rows} == before

  # The CLI's collect mode (as after a cluster sweep) reads the same rows and rewrites the plots.
  os.remove(root / "best_perplexity_vs_compute.png")
  result = run_cli(*cli_flags(tiny_spec(root)), "--mode=collect")
  assert result.returncode == 0, result.stderr[-2000:]
  with open(root / "sweep.json") as f:
    assert json.load(f)["runs"] == json.loads(json.dumps(rows))
  assert matplotlib.image.imread(root / "best_perplexity_vs_compute.png").ndim == 3


@pytest.mark.long
def test_print_mode_prints_one_parsable_command_per_run(finished_sweep):
  root, rows = finished_sweep
  result = run_cli(*cli_flags(tiny_spec(root)), "--mode=print")
  assert result.returncode == 0, result.stderr[-2000:]
  commands = result.stdout.strip().splitlines()
  assert commands == [r["command"] for r in rows]
  for command, row in zip(commands, rows):
    config, workdir = trainer_config(command)
    assert (config.model.ffn.type, config.model.d_model, config.train.steps) == (
      row["ffn_type"],
      row["d_model"],
      row["steps"],
    )
    assert config.data.mixture == (("facts", 1.0),) and workdir == row["workdir"]


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--ffn_types=mlp,dense", "--ffn_types holds 'dense', an unknown feed-forward type"),
    ("--budgets=0", "--budgets holds 0.0; every FLOP budget must be a positive number"),
    ("--budgets=-1e9", "--budgets holds -1000000000.0; every FLOP budget must be a positive number"),
    ("--overrides=config.train.steps=5", "sets config.train.steps, which the sweep derives from the FLOP budget"),
  ],
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
    sweep_tool.run_sweep(tiny_spec(tmp_path, budgets=(1e8,)), "print")


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


def test_d_model_sizes_every_type_by_the_ladders_rules(tmp_path, monkeypatch):
  """Widths by hand from Listing 2 at scale d/128; at d=256 (scale 2) they equal the ladder rung's."""
  monkeypatch.chdir(REPO)
  spec = tiny_spec(
    tmp_path,
    budgets=(1e12,),
    ffn_types=("mlp", "swiglu", "sgatlin", "peer", "moe", "fff"),
    d_models=(32, 256),
    min_steps=1,
  )
  sized = {(run.ffn_type, run.size): run.config.model.ffn for run in sweep.plan(spec)[0]}
  expected = {
    ("mlp", 32): dict(d_ffw=64),
    ("mlp", 256): dict(d_ffw=512),
    ("swiglu", 32): dict(d_ffw=64),
    ("swiglu", 256): dict(d_ffw=512),
    ("sgatlin", 32): dict(d_ffw=19**2),
    ("sgatlin", 256): dict(d_ffw=40**2),
    ("peer", 32): dict(d_ffw=38**2),
    ("peer", 256): dict(d_ffw=80**2),
    ("moe", 32): dict(d_ffw=32),
    ("moe", 256): dict(d_ffw=256),
    ("fff", 32): dict(depth=6, n_trees=1),
    ("fff", 256): dict(depth=6, n_trees=4),
  }
  assert set(sized) == set(expected)
  for key, fields in expected.items():
    assert {name: sized[key][name] for name in fields} == fields, key
  rung = ladder.ladder_model_config(2, "sgatlin").ffn
  assert (
    sized["sgatlin", 256].d_ffw == rung.d_ffw
    and sized["fff", 256].n_trees == ladder.ladder_model_config(2, "fff").ffn.n_trees
  )
