"""The import layering documented in CONTRIBUTING.md holds: no upward edge, no cycle.

Every `import` in sparsetx/ is read from the source (function-level imports included: a lazy import is still
a dependency), so the test needs nothing installed beyond the standard library.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sparsetx"

# Bottom to top, as CONTRIBUTING.md lists them; a module may import its own layer's packages and lower ones.
LAYERS = (
  ("config",),
  ("paths", "cli", "torch_compat", "hardware", "scopes"),
  ("perf",),
  ("data", "kernels"),
  ("parallel",),
  ("models",),
  ("plan",),
  ("train",),
  ("measure",),
  ("evaluate", "interp", "hf", "sparsify"),
  ("tools",),
)
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str, path: pathlib.Path, known: dict) -> set[str]:
  """The sparsetx modules `module` imports (a `from pkg import name` counts `pkg.name` when that is a module)."""
  is_package = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module
      for alias in node.names:
        found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
  return {name for name in found if name == "sparsetx" or name.startswith("sparsetx.")}


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {module: _imports(module, path, modules) - {module} for module, path in modules.items()}


def _room(module: str) -> str | None:
  """The module's package under sparsetx/; a package's `__main__` (`python -m sparsetx.train`) is the alias of its
  program in tools/, so it sits with the programs."""
  parts = module.split(".")
  if parts[-1] == "__main__":
    return "tools"
  return parts[1] if len(parts) > 1 else None


def test_every_room_has_a_layer():
  rooms = {_room(module) for module in _modules()} - {None}
  assert rooms <= set(LAYER_OF), f"add {sorted(rooms - set(LAYER_OF))} to LAYERS here and in CONTRIBUTING.md"


def test_no_upward_import():
  upward = [
    f"{module} -> {target}"
    for module, targets in _graph().items()
    for target in targets
    if _room(module) in LAYER_OF and _room(target) in LAYER_OF and LAYER_OF[_room(target)] > LAYER_OF[_room(module)]
  ]
  assert not upward, "imports against the layering (CONTRIBUTING.md):\n" + "\n".join(sorted(upward))


def test_the_kernels_import_nothing_from_the_measurement_layer():
  """The kernels share nothing with perf/ but the scope names (sparsetx/scopes.py, a leaf both read): the kernel
  benchmarks, which time kernels with perf.timing, sit in measure/ (issues 47, 64)."""
  found = [
    f"{m} -> {t}" for m, targets in _graph().items() if _room(m) == "kernels" for t in targets if _room(t) == "perf"
  ]
  assert not found, found


@pytest.mark.parametrize("level", ["module", "room"])
def test_no_import_cycle(level):
  graph = _graph()
  if level == "room":
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
      source = _room(module)
      rooms.setdefault(source, set()).update(_room(t) for t in targets if _room(t) not in (None, source))
    graph = rooms
  graph = {node: {t for t in targets if t is not None} for node, targets in graph.items() if node is not None}
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for target in sorted(graph.get(node, ())):
      if state.get(target) == 1:
        cycle = path[path.index(target) :] + [target]
        pytest.fail(f"import cycle ({level}s): " + " -> ".join(cycle))
      if target not in state:
        visit(target)
    path.pop()
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node)


def test_models_know_no_mesh():
  """Placement on a mesh (shard_maps, the active mesh) lives in sparsetx/parallel/; the model code only calls it."""
  mesh_calls = ("shard_map", "get_abstract_mesh", "PartitionSpec")
  found = [
    f"{path.relative_to(ROOT)}: {name}"
    for path in sorted((PACKAGE / "models").rglob("*.py"))
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
    for name in [getattr(node, "attr", None) or getattr(node, "id", None) or getattr(node, "name", None)]
    if name in mesh_calls
  ]
  assert not found, "mesh placement inside sparsetx/models/ (move it to sparsetx/parallel/):\n" + "\n".join(found)
