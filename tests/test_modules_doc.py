"""docs/modules.md stays true to the code: a function or class a file's section lists as its own (an indented
entry, `  name   what it does`) is defined in that file."""

import ast
import collections
import re

from conftest import REPO

ENTRY = re.compile(r"^ {2}`?([A-Za-z_]\w*)`?(?:\(\))?:?(?: {2,}|:\s)", re.M)


def definitions() -> dict:
  """{function or class name: the files under sparsetx/ that define it}."""
  found = collections.defaultdict(set)
  for path in (REPO / "sparsetx").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        found[node.name].add(str(path.relative_to(REPO)))
  return found


def listed_names(text: str) -> list[tuple[str, str]]:
  """(section's file, name) for each entry of a section whose name reads as code (snake_case or a class)."""
  listed = []
  for section in re.split(r"^## ", text, flags=re.M)[1:]:
    title, _, body = section.partition("\n")
    for name in ENTRY.findall(body):
      if "_" in name.strip("_") or name[0].isupper():
        listed.append((title.strip(), name))
  return listed


def test_every_listed_function_lives_in_its_sections_file():
  defined = definitions()
  listed = listed_names((REPO / "docs" / "modules.md").read_text())
  assert len(listed) > 20  # the listings are found at all
  elsewhere = [
    (file, name, sorted(defined[name])) for file, name in listed if name in defined and file not in defined[name]
  ]
  assert not elsewhere, elsewhere


def test_an_entry_under_the_wrong_file_is_found():
  text = "## sparsetx/parallel/sparse_forms.py\n\n  on_own_tokens   tables whole on every device\n"
  defined = definitions()
  ((file, name),) = listed_names(text)
  assert file not in defined[name] and "sparsetx/parallel/own_tokens.py" in defined[name]
