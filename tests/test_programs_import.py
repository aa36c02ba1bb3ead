"""Every program module imports next to every other one in one process: none defines an absl flag at import.

absl flags are process-global, and programs share names (--config, --workdir, --dtype, ...), so a module that
defined its flags at import could not be imported by a test next to another such program (DuplicateFlagError, as
CI once failed on bench_data and dry_run). Programs define their flags in `define_flags()`, called by `main()`.
The modules are discovered with pkgutil, so a new program is covered without editing this test.
"""

import json
import os
import subprocess
import sys

from conftest import REPO

CHECK = r"""
import importlib, json, pkgutil
from absl import flags
import sparsetx.tools

names = [f"sparsetx.tools.{m.name}" for m in pkgutil.iter_modules(sparsetx.tools.__path__)]
names += ["sparsetx.train.__main__", "sparsetx.evaluate.__main__"]  # the `python -m` aliases
errors = {}
for name in names:
  try:
    importlib.import_module(name)
  except BaseException as error:  # noqa: BLE001  (reported per module)
    errors[name] = f"{type(error).__name__}: {error}"
ours = {module: sorted(f.name for f in defined) for module, defined in flags.FLAGS.flags_by_module_dict().items()}
ours = {module: flag_names for module, flag_names in ours.items() if module.startswith("sparsetx")}
print(json.dumps(dict(names=names, errors=errors, defined=ours)))
"""


def test_every_program_module_imports_in_one_process_and_defines_no_flag():
  env = dict(os.environ)
  result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["errors"] == {}
  assert {"sparsetx.tools.dry_run", "sparsetx.tools.train", "sparsetx.train.__main__"} <= set(report["names"])
  assert report["defined"] == {}  # a flag defined at import would collide with the next program's of that name
