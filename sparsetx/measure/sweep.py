"""Isoflop sweeps (sgatlin paper Sec. 3.1): the runs that spend each FLOP budget, their commands and results.

More: docs/modules.md, sparsetx/measure/sweep.py.
"""

import dataclasses
import json
import math
import os
import re
import shlex

import ml_collections
from absl import flags
from etils import epath
from ml_collections import config_flags

from sparsetx import cli
from sparsetx import config as config_lib
from sparsetx.data import check_files
from sparsetx.models import ladder
from sparsetx.models.ffn.registry import SPECS

LADDER_CONFIG = "configs/ladder.py"
TRAIN_COMMAND = ("python", "-m", "sparsetx.train")
_OVERRIDE = re.compile(r"^(?:--)?(config(?:\.\w+)+)=(.*)$", re.DOTALL)
_SWEEP_SETS = ("config.train.steps",)  # the sweep owns these fields


@dataclasses.dataclass(frozen=True)
class SweepSpec:
  """What to sweep; `scales` (ladder rungs) or `d_models` (on a base config taking ':FFN'), not both."""

  budgets: tuple[float, ...]
  ffn_types: tuple[str, ...]
  workdir: str
  base_config: str = LADDER_CONFIG
  scales: tuple[int, ...] = ()
  d_models: tuple[int, ...] = ()
  n_layers: tuple[int, ...] = ()  # with d_models: one layer count per d_model; empty keeps the base config's
  overrides: tuple[str, ...] = ()  # 'config.FIELD=VALUE', passed to every run
  min_steps: int = 10


@dataclasses.dataclass(frozen=True)
class Run:
  budget: float
  ffn_type: str
  size: int  # the ladder scale or the d_model
  name: str
  workdir: str
  args: tuple[str, ...]  # the trainer's flags
  config: ml_collections.ConfigDict = dataclasses.field(compare=False, repr=False)
  tokens: int  # the budget's tokens
  tokens_per_step: int
  steps: int
  forward_flops_per_token: int
  total_params: int
  active_params: int

  @property
  def command(self) -> str:
    return shlex.join(TRAIN_COMMAND + self.args)

  @property
  def flops(self) -> int:
    """Training FLOPs actually spent (whole steps)."""
    return 3 * self.forward_flops_per_token * self.steps * self.tokens_per_step


@dataclasses.dataclass(frozen=True)
class Skipped:
  budget: float
  ffn_type: str
  size: int
  name: str
  reason: str


def check_spec(spec: SweepSpec) -> None:
  """One clear error per bad input, before any config is loaded."""
  if not spec.budgets:
    raise config_lib.ConfigError("--budgets is empty; give one or more FLOP budgets, e.g. --budgets=1e17,6e17.")
  for budget in spec.budgets:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
      raise config_lib.ConfigError(
        f"--budgets holds {budget!r}; every FLOP budget must be a positive number, e.g. 1e17."
      )
  if not spec.ffn_types:
    raise config_lib.ConfigError(f"--ffn_types is empty; give one or more of {', '.join(config_lib.FFN_TYPES)}.")
  for ffn_type in spec.ffn_types:
    if ffn_type not in config_lib.FFN_TYPES:
      raise config_lib.ConfigError(
        f"--ffn_types holds {ffn_type!r}, an unknown feed-forward type; use some of {', '.join(config_lib.FFN_TYPES)}."
      )
  if bool(spec.scales) == bool(spec.d_models):
    raise config_lib.ConfigError(
      "give exactly one of --scales (ladder rungs, e.g. --scales=2,3,4) and --d_models (sizes on --base_config, "
      "e.g. --base_config=configs/tiny.py --d_models=32,64)."
    )
  for name, values in (("--scales", spec.scales), ("--d_models", spec.d_models), ("--n_layers", spec.n_layers)):
    for value in values:
      if not isinstance(value, int) or value < 1:
        raise config_lib.ConfigError(f"{name} holds {value!r}; sizes must be positive integers.")
  if spec.n_layers and len(spec.n_layers) != len(spec.d_models):
    raise config_lib.ConfigError(
      f"--n_layers has {len(spec.n_layers)} values for {len(spec.d_models)} --d_models; give one per d_model or none."
    )
  if not os.path.isfile(spec.base_config):
    raise config_lib.ConfigError(
      f"--base_config={spec.base_config} is not a file; give a config path relative to the directory you run from "
      "(the repository root) or an absolute one."
    )
  if not isinstance(spec.min_steps, int) or spec.min_steps < 1:
    raise config_lib.ConfigError(f"--min_steps={spec.min_steps!r} must be a positive integer.")
  for override in spec.overrides:
    match = _OVERRIDE.match(override)
    if not match:
      raise config_lib.ConfigError(
        f"--overrides={override!r} is not 'config.FIELD=VALUE'; write e.g. --overrides=config.train.warmup_steps=10."
      )
    if match.group(1) in _SWEEP_SETS:
      raise config_lib.ConfigError(
        f"--overrides={override!r} sets {match.group(1)}, which the sweep derives from the FLOP budget; remove it."
      )
    swept = ("config.model.d_model",) * bool(spec.d_models) + ("config.model.n_layers",) * bool(spec.n_layers)
    if match.group(1) in swept:
      raise config_lib.ConfigError(
        f"--overrides={override!r} sets {match.group(1)}, which the sweep varies (--d_models, --n_layers); remove it."
      )


def budget_tag(budget: float) -> str:
  """A directory name for a budget: 1e+17 -> '1e17', 6.5e17 -> '6.5e17'."""
  mantissa, exponent = f"{budget:.3e}".split("e")
  return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _sizes(spec: SweepSpec, ffn_type: str) -> list[tuple[int, str, tuple[str, ...]]]:
  """(size, run name, the trainer's config flags without steps) per size of one type."""
  if spec.scales:
    return [(s, f"{ffn_type}_s{s}", (f"--config={spec.base_config}:{ffn_type},{s}",)) for s in spec.scales]
  sizes = []
  for i, d_model in enumerate(spec.d_models):
    args = [
      f"--config={spec.base_config}:{ffn_type}",
      f"--config.model.d_model={d_model}",
      *ffn_size_args(ffn_type, d_model),
    ]
    name = f"{ffn_type}_d{d_model}"
    if spec.n_layers:
      args.append(f"--config.model.n_layers={spec.n_layers[i]}")
      name += f"_l{spec.n_layers[i]}"
    sizes.append((d_model, name, tuple(args)))
  return sizes


def ffn_size_args(ffn_type: str, d_model: int) -> tuple[str, ...]:
  """The trainer flags that size `ffn_type` from d_model by the ladder's rules (sparsetx/models/ladder.py)
  at scale = d_model / 128: mlp/swiglu dense_width; sgatlin (16 + 12 scale)**2 and PEER (32 + 24 scale)**2
  neurons, rounded to a square; MoE experts d_model wide; FFF depth 6 with dense_width // 128 trees (at
  least one). The other knobs (channels, top-k, d_key, experts) stay the base config's. Each type's
  FfnSpec.ladder_size holds its rule."""
  sized = SPECS[ffn_type].ladder_size(d_model) if ffn_type in SPECS else {}
  return tuple(f"--config.model.ffn.{name}={value}" for name, value in sized.items())


def parse_train_args(args: tuple[str, ...]) -> ml_collections.ConfigDict:
  """The validated config `python -m sparsetx.train ARGS` would train (same flag definitions and errors)."""
  argv = ["sparsetx.train", *args]
  flag_values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file(
    "config", None, "Config file.", flag_values=flag_values, lock_config=True, sys_argv=argv
  )
  flags.DEFINE_string("workdir", None, "Run directory.", flag_values=flag_values)
  try:
    cli.config_args(argv, flag_values)
  except config_lib.ConfigError as error:
    raise config_lib.ConfigError(
      f"the run `{shlex.join(TRAIN_COMMAND + tuple(args))}` does not parse: {error}"
    ) from None
  return check_files(config_lib.validate(holder.value))


def plan(spec: SweepSpec) -> tuple[list[Run], list[Skipped]]:
  """The runs of the sweep (budget-major, then type, then size) and the ones too short to train.

  Each size's config is parsed once; a run's config is that one with the budget's steps, which is what
  its command (the same flags plus --config.train.steps) parses to.
  """
  check_spec(spec)
  overrides = tuple("--" + override.removeprefix("--") for override in spec.overrides)
  sizes = {
    ffn_type: [
      (size, name, size_args, parse_train_args(size_args + overrides))
      for size, name, size_args in _sizes(spec, ffn_type)
    ]
    for ffn_type in spec.ffn_types
  }
  runs, skipped = [], []
  for budget in spec.budgets:
    for ffn_type in spec.ffn_types:
      for size, name, size_args, config in sizes[ffn_type]:
        tokens_per_step = config.data.global_batch_size * config.data.seq_len
        forward = ladder.forward_flops_per_token(config.model, config.data.seq_len)["total"]
        tokens = ladder.training_tokens(config.model, budget, config.data.seq_len)
        steps = math.ceil(tokens / tokens_per_step)
        least = max(spec.min_steps, config.train.warmup_steps + 1)
        if steps < least:
          reason = (
            f"{budget:.3g} FLOPs buy {tokens:,} tokens = {steps} steps of {tokens_per_step:,} tokens, fewer than "
            f"{least} (--min_steps={spec.min_steps}, warmup {config.train.warmup_steps} steps)"
          )
          skipped.append(Skipped(budget, ffn_type, size, name, reason))
          continue
        workdir = str(epath.Path(spec.workdir) / budget_tag(budget) / name)  # local or gs://
        args = size_args + overrides + (f"--config.train.steps={steps}", f"--workdir={workdir}")
        params = ladder.param_counts(config.model)
        runs.append(
          Run(
            budget,
            ffn_type,
            size,
            name,
            workdir,
            args,
            _with_steps(config, steps),
            tokens,
            tokens_per_step,
            steps,
            forward,
            params["total"],
            params["active"],
          )
        )
  return runs, skipped


def _with_steps(config: ml_collections.ConfigDict, steps: int) -> ml_collections.ConfigDict:
  """A copy of `config` training `steps` steps, validated as the trainer's flag parsing would."""
  config = config.copy_and_resolve_references()
  config.train.steps = steps
  return config_lib.validate(config)


def final_eval(run: Run) -> dict | None:
  """The run's evaluation at its final step from metrics.jsonl, or None while it is unfinished."""
  path = epath.Path(run.workdir) / "metrics.jsonl"
  if not path.is_file():
    return None
  last = None
  with path.open("r", encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        if line.endswith("\n"):
          raise config_lib.ConfigError(
            f"{path} line {number} is not JSON; move the run directory away to re-run it."
          ) from None
        continue  # a line cut short by a killed run
      if any(key.startswith("eval/") for key in row):
        last = row
  if last is None or last["step"] < run.steps:
    return None
  if last["step"] > run.steps:
    raise config_lib.ConfigError(
      f"{run.workdir} holds a run evaluated at step {last['step']}, but this sweep plans {run.steps} steps for "
      f"{run.name}; use another --workdir or move that run away."
    )
  return last


def result_row(run: Run, evaluation: dict | None, status: str) -> dict:
  """One row of sweep.json: the run's plan, accounting and final validation numbers."""
  model = run.config.model
  row = dict(
    budget=run.budget,
    ffn_type=run.ffn_type,
    size=run.size,
    name=run.name,
    status=status,
    d_model=model.d_model,
    n_layers=model.n_layers,
    total_params=run.total_params,
    active_params=run.active_params,
    forward_flops_per_token=run.forward_flops_per_token,
    tokens=run.tokens,
    tokens_per_step=run.tokens_per_step,
    steps=run.steps,
    trained_tokens=run.steps * run.tokens_per_step,
    flops=run.flops,
    workdir=run.workdir,
    command=run.command,
    step=None,
    loss=None,
    perplexity=None,
    tasks={},
  )
  if evaluation is not None:
    losses = {
      key.split("/")[1]: value for key, value in evaluation.items() if key.startswith("eval/") and key.endswith("/loss")
    }
    row["tasks"] = {
      task: dict(loss=loss, perplexity=evaluation[f"eval/{task}/perplexity"]) for task, loss in losses.items()
    }
    row["step"] = evaluation["step"]
    row["loss"] = sum(losses.values()) / len(losses)
    row["perplexity"] = math.exp(min(row["loss"], 50.0))
  return row
