"""Every command in the documentation's code blocks runs as written, or at least would: checked here.

The commands are read from the fenced code blocks of README.md, CONTRIBUTING.md, deploy/README.md and docs/*.md
(`\\` continuations joined, `VAR=value` lines and prefixes, comments dropped), and from the example lines of the
programs' docstrings (their --help). A command that takes seconds runs for real (`python -c ...`; the tiny config's
dry runs, cut to a short context by flags this test appends). The rest are checked as their programs would check
them, without training or compiling: the module exists and defines main(); the program's own parser (its absl
flags and `sparsetx.cli.config_args`, or lm-eval's argparse) accepts every flag, loads the `--config` file with its
`:ARG` and applies every `--config.x.y` override; the config validates; and the mesh it declares
(config.mesh.ici/dcn after the overrides) fits the devices the command declares (`--devices`, an
`XLA_FLAGS=--xla_force_host_platform_device_count=N` prefix, launch_local's processes x devices, else the one CPU
device), with the batch divisible over it and no large parameter fully replicated (`state.setup` on abstract
shapes). A docstring synopsis (with [optional] parts or placeholders) is checked for its flag names. `make` targets
exist and their recipes' Python commands are checked the same way; pip extras exist in pyproject.toml. A command of
any other form fails the test: nothing is skipped. The program checks run in one fresh process, since absl flags
are process-global and several programs define the same names.
"""

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO

DOCUMENTS = [
  "README.md",
  "CONTRIBUTING.md",
  "deploy/README.md",
  *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
]
SHELL_LANGUAGES = {"sh", "bash", "shell", "console", ""}
PYTHONS = {"python", "python3", "python3.12", ".venv/bin/python", "$(PY)"}
DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
  """(line number, language, body) of each ``` block."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    opening = re.match(r"^\s*```(\S*)\s*$", lines[i])
    if opening:
      start, body = i + 1, []
      i += 1
      while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
        body.append(lines[i])
        i += 1
      blocks.append((start, opening.group(1), "\n".join(body)))  # start: the line of the opening fence
    i += 1
  return blocks


def shell_commands(body: str, document: str, first_line: int) -> list[dict]:
  """The commands of a shell block, {where, env, argv}; `NAME=value` lines set variables for the later lines."""
  variables, commands, pending, start = {}, [], "", None
  for number, raw in enumerate(body.splitlines(), first_line):
    start = number if not pending else start
    if raw.rstrip().endswith("\\"):
      pending += raw.rstrip()[:-1] + " "
      continue
    line, pending = pending + raw, ""
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
      name, value = words.pop(0).split("=", 1)
      env[name] = value
    if not words:
      variables.update(env)  # a line that only sets variables
      continue
    commands.append({"where": f"{document}:{start}", "env": env, "argv": words})
  return commands


def documented_commands() -> list[dict]:
  commands = []
  for document in DOCUMENTS:
    for line, language, body in fenced_blocks((REPO / document).read_text()):
      where = f"{document}:{line}"
      if language == "python":
        continue  # code, not a command: test_python_blocks_parse compiles it
      assert language in SHELL_LANGUAGES, f"{where}: a ```{language} block is neither shell nor python"
      commands += shell_commands(body, document, line + 1)
  return commands


# A reader who followed README's set-up has .venv (which the environment running these tests stands for) and, once they
# activate it as README says near its top, its bin/ on the PATH; make and docker are the machine's own.
VENV_BIN = os.path.dirname(sys.executable)
ACTIVATE = "source .venv/bin/activate"
MACHINE_PROGRAMS = {"make", "docker"}


def reader_finds(program: str, where: str, readme: str | None = None) -> None:
  """The program a command starts is where a reader after README's set-up runs it from: `.venv/bin/NAME` names a file
  of .venv/bin; a bare NAME is one too, and README tells the reader to activate .venv; else the machine's own."""
  if program in MACHINE_PROGRAMS:
    return
  name = program.removeprefix(".venv/bin/")
  assert "/" not in name and os.path.isfile(os.path.join(VENV_BIN, name)), (
    f"{where}: {program} is not found after README's set-up (no {name} in .venv/bin)"
  )
  if name == program:
    readme = (REPO / "README.md").read_text() if readme is None else readme
    assert ACTIVATE in readme, f"{where}: {program} is on the PATH only in an activated .venv, and README never says so"


PROGRAM_START = re.compile(r"^(\.venv/bin/)?python3? -m sparsetx\.|^sparsetx-[\w-]+ ")
SYNOPSIS = re.compile(r"\[|\.\.\.|\b[A-Z]{3,}\b")  # [optional] parts, `...`, placeholders such as DIR


def docstring_commands() -> list[dict]:
  """The example commands of the programs' docstrings (what their --help shows): a line starting with a program,
  with its `\\` continuations and the more indented lines of optional flags below it. A synopsis (with [optional]
  parts, `...` or a placeholder such as DIR) is checked for its flag names only; the rest as commands."""
  commands = []
  for path in sorted((REPO / "sparsetx" / "tools").glob("*.py")):
    lines = (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()
    i = 0
    while i < len(lines):
      text, indent = lines[i].strip(), len(lines[i]) - len(lines[i].lstrip())
      where = f"{path.relative_to(REPO)}:docstring line {i + 1}"
      i += 1
      if not PROGRAM_START.match(text):
        continue
      while i < len(lines) and (
        text.endswith("\\") or (len(lines[i]) - len(lines[i].lstrip()) > indent and lines[i].strip()[:1] in "[-")
      ):
        text = text.removesuffix("\\") + " " + lines[i].strip()
        i += 1
      (command,) = shell_commands(text, where, 0)
      command["where"] = where
      if SYNOPSIS.search(text.split("#")[0]):
        command["names"] = sorted(set(re.findall(r"(?<![\w-])--([\w.]+)", text.split("#")[0])))
      commands.append(command)
  return commands


def python_blocks() -> list[tuple[str, str]]:
  return [
    (f"{document}:{line}", body)
    for document in DOCUMENTS
    for line, language, body in fenced_blocks((REPO / document).read_text())
    if language == "python"
  ]


def pyproject() -> dict:
  with open(REPO / "pyproject.toml", "rb") as f:
    return tomllib.load(f)


def make_recipes() -> tuple[dict, dict]:
  """(variables, {target: recipe command lines}) of the Makefile, `$(VAR)` left unexpanded."""
  variables, recipes, target = {}, {}, None
  for line in (REPO / "Makefile").read_text().splitlines():
    if line.startswith("\t") and target:
      recipes[target].append(line.strip().lstrip("@"))
      continue
    assignment = re.match(r"^(\w+)\s*[?:]?=\s*(.*)$", line)
    rule = re.match(r"^([\w./$()-]+)\s*:(?!=)", line)
    if assignment:
      variables[assignment.group(1)] = assignment.group(2).strip()
      target = None
    elif rule:
      target = rule.group(1)
      recipes[target] = []
  return variables, recipes


def expand_make(line: str, variables: dict) -> str:
  for _ in range(5):
    line = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
  return line


def program_of(argv: list[str]) -> tuple[str, list[str]] | None:
  """(module, arguments) of a Python program command, else None."""
  scripts = pyproject()["project"]["scripts"]
  if argv[0].removeprefix(".venv/bin/") in scripts:
    module = scripts[argv[0].removeprefix(".venv/bin/")].split(":")[0]
    module = {"sparsetx.tools.train": "sparsetx.train", "sparsetx.tools.evaluate": "sparsetx.evaluate"}.get(
      module, module
    )
    return module, argv[1:]
  if argv[0] in PYTHONS and len(argv) > 2 and argv[1] == "-m":
    return argv[2], argv[3:]
  return None


# Documented commands that also run for real, cut down by the flags appended here (the last value of a flag wins):
# the dry runs of the tiny config, at a short context (a compile of seconds).
CUT_DOWN = {"sparsetx.tools.dry_run": ["--config.data.seq_len=64", "--config.model.max_len=64"]}


def runs_for_real(module: str, args: list[str]) -> bool:
  return module in CUT_DOWN and "--config=configs/tiny.py" in args and "--remat_sweep" not in args


def plan(command: dict) -> list[dict]:
  """What checking `command` takes: [{kind: run|program|ok, ...}], or an AssertionError naming what is wrong."""
  argv, env, where = command["argv"], command["env"], command["where"]
  if argv[0] == "source":  # README's activation of .venv
    assert argv[1:] == [".venv/bin/activate"] and os.path.isfile(os.path.join(VENV_BIN, "activate")), where
    return [{"kind": "ok", "where": where, "what": "activating .venv"}]
  reader_finds(argv[0], where)
  if argv[0].removeprefix(".venv/bin/") == "tensorboard":  # make train's closing line: a server, not run here
    assert argv[1:2] == ["--logdir"] and len(argv) == 3, f"{where}: tensorboard takes --logdir DIR"
    return [{"kind": "ok", "where": where, "what": "tensorboard, installed in .venv"}]
  program = program_of(argv)
  if program is not None and not program[0].startswith("sparsetx"):  # another package's program (make test's pytest)
    module, args = program
    assert importlib.util.find_spec(module), f"{where}: no module {module}"
    if "-n" in args:
      assert importlib.util.find_spec("xdist"), f"{where}: pytest -n needs pytest-xdist"
    return [{"kind": "ok", "where": where, "what": f"python -m {module}"}]
  if program is not None:
    module, args = program
    check = {
      "kind": "program",
      "where": where,
      "module": module,
      "args": args,
      "env": env,
      "names": command.get("names"),
    }
    if check["names"] is None and runs_for_real(module, args):
      real = [sys.executable, "-m", module, *args, *CUT_DOWN[module]]
      return [check, {"kind": "run", "where": where, "argv": real, "env": env}]
    return [check]
  if argv[0] in PYTHONS and argv[1:2] == ["-c"]:
    return [{"kind": "run", "where": where, "argv": [sys.executable, *argv[1:]], "env": env}]
  if argv[0] == "make":
    variables, recipes = make_recipes()
    targets = [a for a in argv[1:] if "=" not in a] or [next(iter(recipes))]
    variables.update(a.split("=", 1) for a in argv[1:] if "=" in a)
    steps = []
    for target in targets:
      assert target in recipes, f"{where}: the Makefile has no target {target!r} (it has {sorted(recipes)})"
      for recipe in recipes[target]:
        words = shlex.split(expand_make(recipe, {**variables, "PY": ".venv/bin/python"}))
        if program_of(words) is not None:  # the Python programs a target runs are checked as documented ones
          steps += plan({"where": f"{where} (make {target})", "env": env, "argv": words})
    return steps or [{"kind": "ok", "where": where, "what": f"make target(s) {targets}"}]
  if re.fullmatch(r"(\.venv/bin/)?pip3?", argv[0]) and argv[1:2] == ["install"]:
    extras = pyproject()["project"]["optional-dependencies"]
    for arg in argv[2:]:
      match = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
      if match:
        missing = set(match.group(1).split(",")) - set(extras)
        assert not missing, f"{where}: pyproject.toml defines no extra {sorted(missing)} (it has {sorted(extras)})"
    return [{"kind": "ok", "where": where, "what": "pip install of existing extras"}]
  if argv[0] == "docker" and argv[1:2] == ["build"]:  # the image of deploy/k8s: its Dockerfile and an existing extra
    dockerfile = argv[argv.index("-f") + 1]
    assert (REPO / dockerfile).is_file(), f"{where}: no {dockerfile}"
    extras = pyproject()["project"]["optional-dependencies"]
    for arg in argv:
      if arg.startswith("EXTRA="):
        assert arg[len("EXTRA=") :] in extras, (
          f"{where}: pyproject.toml defines no extra {arg} (it has {sorted(extras)})"
        )
    return [{"kind": "ok", "where": where, "what": f"docker build of {dockerfile}"}]
  if argv[:2] == ["docker", "push"]:
    return [{"kind": "ok", "where": where, "what": "docker push of the built image"}]
  raise AssertionError(f"{where}: {shlex.join(argv)!r} is not a command this test knows how to check; teach it")


# Runs in a fresh process with enough simulated devices for every documented mesh. Reads the program checks (JSON)
# on stdin and prints {where: error or null}.
CHECKER = r"""
import importlib, json, math, os, re, sys
from absl import app, flags, logging  # noqa: F401  (their flags are everyone's: --helpfull, --verbosity, ...)

FLAGS = flags.FLAGS
BASE = set(FLAGS)
MODULE_FILES = {"sparsetx.train": "sparsetx.tools.train", "sparsetx.evaluate": "sparsetx.tools.evaluate"}


def load(module_name):
  '''Imports the program afresh (its flags defined, the previous program's removed); returns (module, has main).'''
  for name in list(FLAGS):
    if name not in BASE:  # the previous program's flags, and the --config.x.y overrides its parse registered
      delattr(FLAGS, name)
  FLAGS.unparse_flags()
  before = set(FLAGS)
  name = MODULE_FILES.get(module_name, module_name)
  sys.modules.pop(name, None)
  module = importlib.import_module(name)
  if hasattr(module, "define_flags"):  # a program that defines its flags only when run (sweep)
    module.define_flags()
  load.defined = set(FLAGS) - before
  return module, callable(getattr(module, "main", None))
load.defined = set()


def parse(module_name, args):
  '''The program's own parsing of its command line: absl flags, the config file and its overrides.'''
  from sparsetx import cli
  module, has_main = load(module_name)
  if not has_main:
    raise AssertionError(f"{module_name} defines no main()")
  sys.argv = [module_name, *args]  # ml_collections reads the overrides from sys.argv
  rest = cli.config_args(sys.argv, FLAGS)
  return rest[1:]


def mesh_fits(config, processes, devices_per_process):
  '''config.mesh on processes x devices: dcn over the processes, ici over each one's devices; then the batch and
  the parameters on the whole mesh, as state.setup checks them (abstract shapes; nothing is allocated).'''
  import jax
  from sparsetx import config as config_lib
  from sparsetx.data import check_files
  from sparsetx.parallel import mesh as mesh_lib
  from sparsetx.train import state as state_lib
  config = config_lib.validate(config.copy_and_resolve_references())
  check_files(config)
  dcn = mesh_lib.axis_sizes(dict(config.mesh.dcn), processes, "dcn")
  ici = mesh_lib.axis_sizes(dict(config.mesh.ici), devices_per_process, "ici")
  total = processes * devices_per_process
  if total > jax.device_count():
    raise AssertionError(f"{total} devices declared; the checker has {jax.device_count()}")
  flat = config.copy_and_resolve_references()
  flat.mesh.ici.update(dict(zip(config_lib.MESH_AXES, [i * d for i, d in zip(ici, dcn)])))
  flat.mesh.dcn.update({axis: 1 for axis in config_lib.MESH_AXES})
  state_lib.setup(flat, jax.devices()[:total])


def device_count(env):
  match = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
  return int(match.group(1)) if match else 1


def check_names(module_name, names):
  '''A synopsis: each --name is a flag of the program (--noNAME of a boolean one), --config.x.y a config field.'''
  from sparsetx import config as config_lib
  if module_name == "sparsetx.tools.lm_eval_cli":
    from lm_eval._cli.harness import HarnessCLI
    parser = HarnessCLI()._subparsers.choices["run"]
    known = {option.lstrip("-") for action in parser._actions for option in action.option_strings}
    booleans = set()
  else:
    _, has_main = load(module_name)
    assert has_main, f"{module_name} defines no main()"
    known = set(FLAGS)
    booleans = {name for name in FLAGS if isinstance(FLAGS[name], flags.BooleanFlag)}
  for name in names:
    if name.startswith("config."):
      assert "config" in known, f"--{name}: the program has no --config"
      node = config_lib.default_config()
      for part in name.split(".")[1:]:
        assert part in node, f"--{name}: the config has no field {part!r} there"
        node = node[part]
    else:
      assert name in known or (name[:2] == "no" and name[2:] in booleans), f"--{name} is not a flag of {module_name}"


def check(item):
  module_name, args, env = item["module"], item["args"], item["env"]
  if item.get("names") is not None:
    return check_names(module_name, item["names"])
  if module_name == "sparsetx.tools.lm_eval_cli":
    from lm_eval._cli.harness import HarnessCLI
    _, has_main = load(module_name)
    assert has_main, f"{module_name} defines no main()"
    sys.argv = ["lm-eval", *args]
    try:
      parsed = HarnessCLI().parse_args()
    except SystemExit as exit:
      raise AssertionError(f"lm-eval's parser refused {args} (exit {exit.code})") from None
    for path in (parsed.include_path or "").split(":") if getattr(parsed, "include_path", None) else []:
      assert os.path.isdir(path), f"--include_path {path} is not a directory"
    return
  rest = parse(module_name, args)
  if module_name == "sparsetx.tools.launch_local":
    processes, per_process, worker = FLAGS.num_processes, FLAGS.devices_per_process, FLAGS.module
    worker_args = rest[1:] if rest[:1] == ["--"] else rest
    assert not parse(worker, worker_args), f"positional arguments for {worker}"
    mesh_fits(FLAGS.config, processes, per_process)
    return
  assert not rest, f"positional arguments {rest} that the program does not take"
  if module_name == "sparsetx.tools.dry_run":
    config = FLAGS.config
    if FLAGS.split_d_model:
      config = sys.modules["sparsetx.tools.dry_run"].with_d_model_split(config)
    from sparsetx.measure import aot

    topology = sys.modules["sparsetx.tools.dry_run"].resolve_topology(FLAGS.topology, config)
    if topology != "cpu":  # compiled for a machine's topology: its devices, as the dry run lays the state out
      from sparsetx import config as config_lib
      from sparsetx.train import state as state_lib
      config = config_lib.validate(config.copy_and_resolve_references())
      state_lib.setup(config, mesh=aot.topology_mesh(config, topology))
      return
    granules = aot.dcn_granule_count(config) or 1  # the dry run simulates a dcn mesh's nodes on its devices
    mesh_fits(config, granules, FLAGS.devices // granules)
  elif module_name == "sparsetx.evaluate":
    spec = FLAGS.mesh
    if spec not in ("one", "saved"):
      sizes = [int(part.split("=", 1)[1]) for part in spec.split(",")]
      devices = device_count(env)
      assert devices % math.prod(sizes) == 0, f"--mesh={spec} does not fit {devices} device(s)"
  elif module_name == "sparsetx.tools.sweep":
    from sparsetx.tools import sweep as sweep_tool
    from sparsetx.measure import sweep as sweep_lib
    values = {name: FLAGS[name].value for name in load.defined}
    runs, _ = sweep_lib.plan(sweep_tool.spec_from_flags(values))  # every run's config parsed, overrides applied
    assert runs, "every run of the sweep is too short to train"
  elif "config" in load.defined and "workdir" in load.defined and module_name in ("sparsetx.train",):
    mesh_fits(FLAGS.config, 1, device_count(env))
  elif "config" in load.defined and FLAGS["config"].present:
    from sparsetx import config as config_lib
    config_lib.validate(FLAGS.config.copy_and_resolve_references())


results = {}
for item in json.load(sys.stdin):
  try:
    check(item)
    results[item["where"]] = None
  except BaseException as error:  # noqa: BLE001  (reported per command)
    results[item["where"]] = f"{type(error).__name__}: {error}"
print("CHECKER" + json.dumps(results))
"""


def check_programs(items: list[dict]) -> dict:
  """{where: error or None} for each program check, all in one fresh process."""
  devices = max([64, *(int(n) for i in items for n in DEVICE_COUNT.findall(i["env"].get("XLA_FLAGS", "")))])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", CHECKER],
    input=json.dumps(items),
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  lines = [line for line in result.stdout.splitlines() if line.startswith("CHECKER")]
  assert result.returncode == 0 and lines, result.stderr[-3000:]
  return json.loads(lines[-1][len("CHECKER") :])


COMMANDS = documented_commands() + docstring_commands()


def test_the_documents_hold_the_commands_of_each_kind():
  """The extraction finds what the README is known to document (a parser that finds nothing passes nothing)."""
  modules = {step.get("module") for command in COMMANDS for step in plan(command)}
  assert {"sparsetx.train", "sparsetx.tools.dry_run", "sparsetx.tools.sweep", "sparsetx.tools.launch_local"} <= modules
  assert any(command["argv"][:2] == ["make", "train"] for command in COMMANDS)
  assert any("XLA_FLAGS" in command["env"] for command in COMMANDS)
  assert any(command["argv"][0] == "sparsetx-tokenize" for command in COMMANDS)  # a bare program: found once activated


def test_a_program_the_reader_cannot_find_is_refused():
  reader_finds(".venv/bin/sparsetx-train", "x")
  reader_finds("sparsetx-train", "x", readme=f"... {ACTIVATE} ...")
  with pytest.raises(AssertionError, match="no sparsetx-nonesuch in .venv/bin"):
    reader_finds("sparsetx-nonesuch", "x")
  with pytest.raises(AssertionError, match="README never says so"):
    reader_finds("sparsetx-train", "x", readme="no word of activating")
  with pytest.raises(AssertionError, match="/opt/tools/tensorboard is not found after README"):
    reader_finds("/opt/tools/tensorboard", "x")  # a path of the writer's machine


def test_make_trains_closing_line_runs_as_printed():
  """The line `make train` ends with names the TensorBoard command a reader copies: installed where it says."""
  _, recipes = make_recipes()
  (echo,) = [line for line in recipes["train"] if line.startswith("echo ") and "TensorBoard:" in line]
  command = re.search(r"TensorBoard: (.*?)(?:  |\"$)", echo).group(1)
  argv = shlex.split(expand_make(command, {"WORKDIR": "workdir/tiny"}))
  assert [step["kind"] for step in plan({"where": "make train's last line", "env": {}, "argv": argv})] == ["ok"]


@pytest.mark.parametrize("where,body", python_blocks(), ids=[w for w, _ in python_blocks()])
def test_python_blocks_parse(where, body):
  compile(body, where, "exec")


def _documented(module: str, *words: str) -> dict:
  """The first documented check of `module` whose arguments hold all `words`."""
  for command in COMMANDS:
    for step in plan(command):
      if step.get("module") == module and all(any(w in a for a in step["args"]) for w in words):
        return step
  raise AssertionError(f"no documented {module} command with {words}")


def _mutated(step: dict, old: str, new: str) -> dict:
  """`step` with the regular expression `old` replaced by `new` in its arguments."""
  args = [re.sub(old, new, a) for a in step["args"]]
  assert args != step["args"], (old, step["args"])
  return {**step, "args": args, "where": f"{step['where']} with {old!r} -> {new!r}"}


# Changes a documented command could suffer (or a program, in the other direction): each must be caught.
_DRY_RUN = _documented("sparsetx.tools.dry_run", "--devices=", "--config.mesh.ici.expert=")
_TRAIN = _documented("sparsetx.train", "--config.mesh.ici.data=")
MUTATIONS = {
  "renamed flag": (_mutated(_DRY_RUN, "--devices=", "--num_devices="), "num_devices"),
  "renamed config field": (_mutated(_TRAIN, "--config.mesh.ici.data=", "--config.mesh.ici.dataa="), "dataa"),
  "mesh larger than the devices": (_mutated(_DRY_RUN, r"--devices=\d+", "--devices=3"), "does not divide"),
  "unknown config argument": (_mutated(_TRAIN, r"configs/tiny.py:fff$", "configs/tiny.py:ffff"), "ffff"),
}


def run(step: dict) -> str | None:
  """Runs a command step for real; its error output when it fails."""
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu", **step["env"]}
  result = subprocess.run(step["argv"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  return None if result.returncode == 0 else f"exit {result.returncode}\n{result.stderr[-2000:]}"


@pytest.mark.slow
def test_documented_commands_run_and_broken_ones_fail():
  """Every documented command runs or passes its program's checks (the failures listed together), and each
  mutation above is refused. One test, so that one process checks all the commands, under pytest-xdist too."""
  failures, steps = [], []
  for command in COMMANDS:
    try:
      steps += [(command, step) for step in plan(command)]
    except AssertionError as error:
      failures.append(str(error))
  programs = [step for _, step in steps if step["kind"] == "program"]
  checked = check_programs(programs + [mutation for mutation, _ in MUTATIONS.values()])
  for command, step in steps:
    error = run(step) if step["kind"] == "run" else checked[step["where"]] if step["kind"] == "program" else None
    if error is not None:
      failures.append(f"{step['where']}: {shlex.join(command['argv'])}\n  {error}")
  for name, (mutation, expected) in MUTATIONS.items():
    error = checked[mutation["where"]]
    if error is None or expected not in error:
      failures.append(f"{name} ({mutation['where']}) was not refused with {expected!r}: {error}")
  assert not failures, "\n\n".join(failures)
