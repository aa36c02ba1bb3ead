"""docs/modules.md stays true to the code: a function, class or module-level name a file's section lists as its
own (an indented entry, `  name   what it does`) is defined in that file; an entry that names no definition (a
batch field, a metric, a platform) is a word the code uses."""

import ast
import collections
import re

from conftest import REPO

ENTRY = re.compile(r"^ {2}`?([A-Za-z_]\w*)`?(?:\(\))?:?(?: {2,}|:\s)", re.M)


def definitions(constants: bool = False) -> dict:
  """{function or class name (or with `constants`, module-level variable): the files under sparsetx/ defining it}."""
  found = collections.defaultdict(set)
  for path in (REPO / "sparsetx").rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if not constants else tree.body:
      if not constants and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        found[node.name].add(str(path.relative_to(REPO)))
      if constants and isinstance(node, ast.Assign | ast.AnnAssign):
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
          for name in ast.walk(target):
            if isinstance(name, ast.Name):
              found[name.id].add(str(path.relative_to(REPO)))
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
  defined, constants = definitions(), definitions(constants=True)
  listed = listed_names((REPO / "docs" / "modules.md").read_text())
  assert len(listed) > 20  # the listings are found at all
  words = set(re.findall(r"\w+", "\n".join(path.read_text() for path in (REPO / "sparsetx").rglob("*.py"))))
  wrong = [
    (file, name, sorted(defined.get(name, ())))
    for file, name in listed
    if file not in defined.get(name, set()) | constants.get(name, set()) and (name in defined or name not in words)
  ]
  assert not wrong, wrong  # defined in another file, or nowhere in the code (renamed or deleted)


def test_an_entry_under_the_wrong_file_is_found():
  text = "## sparsetx/parallel/sparse_forms.py\n\n  on_own_tokens   tables whole on every device\n"
  defined = definitions()
  ((file, name),) = listed_names(text)
  assert file not in defined[name] and "sparsetx/parallel/own_tokens.py" in defined[name]


def test_every_file_the_page_names_exists():
  """A section's title, and every path the page writes (`sparsetx/kernels/rows/triton.py`, `rows/records.py`), names
  a file that exists: a file moved or renamed leaves no section or line behind under its old path."""
  text = (REPO / "docs" / "modules.md").read_text()
  titles = [section.partition("\n")[0].strip() for section in re.split(r"^## ", text, flags=re.M)[1:]]
  files = {str(path.relative_to(REPO / "sparsetx")) for path in (REPO / "sparsetx").rglob("*.py")}
  missing = [title for title in titles if title.startswith("sparsetx/") and not (REPO / title).exists()]
  for path in set(re.findall(r"(?<![\w./])((?:sparsetx/)?(?:[a-z_]+/)+[a-z_]+\.py)\b", text)):
    relative = path.removeprefix("sparsetx/")
    if not (relative in files or any(f.endswith("/" + relative) for f in files) or (REPO / path).exists()):
      missing.append(path)
  assert not missing, sorted(missing)
