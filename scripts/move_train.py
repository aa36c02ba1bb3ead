"""Moves train/'s modules into rooms by concern (issue 64) and rewrites every reference; re-runnable.

Run from the repository root: `python /tmp/move_train.py`. A move already made is skipped; a rewrite already made
matches nothing, so a second run after `git rebase main` only fixes the imports others added since.
"""

import ast
import pathlib
import re
import subprocess
import sys

# old dotted module -> new dotted module
MOVES = {
  **{
    f"sparsetx.train.{m}": f"sparsetx.train.run.{m}"
    for m in ("loop", "watchdog", "goodput", "recovery", "compile_cache", "ctrl_c")
  },
  **{
    f"sparsetx.train.{m}": f"sparsetx.train.checkpoints.{m}"
    for m in ("checkpointing", "param_reader", "param_writer", "held_errors")
  },
  **{
    f"sparsetx.train.{m}": f"sparsetx.train.tracking.{m}"
    for m in ("metrics", "wandb_writer", "scalars_only", "sparse_stats", "usage_window")
  },
  **{f"sparsetx.train.{m}": f"sparsetx.measure.{m}" for m in ("aot", "step_bench", "kernel_bench", "sweep")},
  "sparsetx.train.autotune": "sparsetx.plan.autotune",
}

ROOT = pathlib.Path.cwd()
BINARY_SUFFIXES = {".png", ".jpg", ".pdf", ".gz", ".zst", ".parquet", ".npz", ".safetensors", ".tfrecord"}
SKIP = {"scripts/move_train.py"}


def path_of(dotted: str) -> str:
  return dotted.replace(".", "/") + ".py"


def git(*args) -> str:
  return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def move_files() -> None:
  for old, new in MOVES.items():
    src, dst = ROOT / path_of(old), ROOT / path_of(new)
    if src.exists() and not dst.exists():
      dst.parent.mkdir(parents=True, exist_ok=True)
      git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
    elif src.exists() and dst.exists():
      sys.exit(f"both {src} and {dst} exist: merge them by hand")


def rewrite_from_imports(text: str) -> str:
  """`from sparsetx.train import a, b as c` whose names moved: one statement per package the names now live in."""
  try:
    tree = ast.parse(text)
  except SyntaxError:
    return text
  lines = text.splitlines(keepends=True)
  edits = []
  for node in ast.walk(tree):
    if not (
      isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in {o.rsplit(".", 1)[0] for o in MOVES}
    ):
      continue
    if not any(f"{node.module}.{a.name}" in MOVES for a in node.names):
      continue
    groups: dict[str, list[str]] = {}
    for a in node.names:
      full = f"{node.module}.{a.name}"
      package, name = MOVES[full].rsplit(".", 1) if full in MOVES else (node.module, a.name)
      groups.setdefault(package, []).append(name + (f" as {a.asname}" if a.asname else ""))
    first, last = node.lineno - 1, node.end_lineno - 1
    head = lines[first][: node.col_offset]
    tail_line = lines[last]
    after = tail_line[node.end_col_offset :]
    comment = after.rstrip("\n")
    newline = "\n" if tail_line.endswith("\n") else ""
    new = [
      f"{head if i == 0 else ' ' * len(head) if head.strip() == '' else head}from {pkg} import {', '.join(names)}"
      for i, (pkg, names) in enumerate(sorted(groups.items()))
    ]
    new = [line + (comment if i == len(new) - 1 else "") for i, line in enumerate(new)]
    edits.append((first, last, "\n".join(new) + newline))
  for first, last, new in sorted(edits, reverse=True):
    lines[first : last + 1] = [new]
  return "".join(lines)


def rewrite_quoted_imports(text: str) -> str:
  """The same inside strings (a child process's source): one `from P import a, b as c` per line, no parentheses."""

  def split(match):
    head, module, names, tail = match.groups()
    if not any(f"{module}.{n.split()[0]}" in MOVES for n in names.split(",")):
      return match.group(0)
    groups: dict[str, list[str]] = {}
    for n in (n.strip() for n in names.split(",")):
      full = f"{module}.{n.split()[0]}"
      package, name = MOVES[full].rsplit(".", 1) if full in MOVES else (module, n.split()[0])
      groups.setdefault(package, []).append(" ".join([name, *n.split()[1:]]))
    lines = [f"{head}from {pkg} import {', '.join(names)}" for pkg, names in sorted(groups.items())]
    return "\n".join(lines) + tail

  packages = "|".join(sorted({re.escape(o.rsplit(".", 1)[0]) for o in MOVES}))
  return re.sub(rf"^([ \t]*)from ({packages}) import ([\w ,]+?)([ \t]*(?:#.*)?)$", split, text, flags=re.M)


def rewrite_text(text: str) -> str:
  text = rewrite_quoted_imports(text)
  for old, new in MOVES.items():
    # dotted: imports, mock.patch strings, -m module paths, entry points
    text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
    # paths: sparsetx/train/x.py and the short train/x.py
    old_path, new_path = path_of(old), path_of(new)
    text = re.sub(rf"(?<![\w./]){re.escape(old_path)}\b", new_path, text)
    short_old, short_new = old_path.removeprefix("sparsetx/"), new_path.removeprefix("sparsetx/")
    text = re.sub(rf"(?<![\w./]){re.escape(short_old)}\b", short_new, text)
  return text


def main() -> None:
  move_files()
  for name in git("ls-files").splitlines():
    path = ROOT / name
    if name in SKIP or not path.is_file() or path.suffix in BINARY_SUFFIXES:
      continue
    try:
      text = path.read_text()
    except UnicodeDecodeError:
      continue
    new = rewrite_text(rewrite_from_imports(text) if path.suffix == ".py" else text)
    if new != text:
      path.write_text(new)
      print("rewrote", name)


if __name__ == "__main__":
  main()
