"""The command-line programs are sparsetx.tools modules, each named by pyproject.toml's [project.scripts].

Every script target imports and is a callable taking no arguments (what a console script calls), every
program module has one, each runs as `python -m sparsetx.tools.NAME` through the same `main`, and no module
edits sys.path. The imports run in one fresh process: absl flags are process-global and several programs
define the same names (--config, --workdir), so each program's flags are removed before the next is imported.
"""

import ast
import json
import os
import subprocess
import sys
import tomllib

from conftest import REPO

TOOLS = REPO / "sparsetx" / "tools"


def scripts() -> dict[str, str]:
  with open(REPO / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["scripts"]


def program_modules() -> set[str]:
  return {f"sparsetx.tools.{path.stem}" for path in TOOLS.glob("*.py") if path.stem != "__init__"}


def test_every_program_has_one_script_and_every_script_names_a_program():
  targets = [target.split(":") for target in scripts().values()]
  assert all(function == "main" for _, function in targets), targets
  modules = [module for module, _ in targets]
  assert sorted(modules) == sorted(program_modules())  # one script per program, no script elsewhere
  assert all(name.startswith("sparsetx-") for name in scripts())


def test_every_program_runs_its_main_as_a_module():
  """`python -m sparsetx.tools.NAME` calls the same `main()` the script calls (the file's last statement)."""
  for path in TOOLS.glob("*.py"):
    if path.stem == "__init__":
      continue
    last = ast.parse(path.read_text()).body[-1]
    assert ast.unparse(last) == "if __name__ == '__main__':\n    main()", path.name


def test_no_module_edits_sys_path():
  for path in (REPO / "sparsetx").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
        raise AssertionError(f"{path.relative_to(REPO)} line {node.lineno} uses sys.path")


CHECK = r"""
import inspect, json, os, sys
from absl import flags


def load(module_name):
  before = set(flags.FLAGS)
  module = __import__(module_name, fromlist=["_"])
  for flag in set(flags.FLAGS) - before:  # the next program may define the same names
    delattr(flags.FLAGS, flag)
  return module


# No program reads the command line at import (dry_run sets its device count when it runs).
sys.argv = ["sparsetx-dry-run", "--devices=3"]
report = {"targets": {}}
for name, target in json.loads(os.environ["TARGETS"]).items():
  module_name, function_name = target.split(":")
  function = getattr(load(module_name), function_name)
  parameters = inspect.signature(function).parameters.values()
  report["targets"][name] = callable(function) and all(p.default is not p.empty for p in parameters)
report["xla_flags"] = os.environ.get("XLA_FLAGS")
print(json.dumps(report))
"""


def test_every_script_target_imports_and_is_callable_without_arguments():
  targets = scripts()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["TARGETS"] = json.dumps(targets)
  result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["targets"] == {name: True for name in targets}
  assert report["xla_flags"] is None  # importing the programs set no device count from sys.argv
