"""Every repository path that the package's docstrings and comments or the documentation name exists (a file or
folder of this checkout): a renamed or deleted file cannot leave its old name behind in the prose. Module
docstrings stay short."""

import ast
import re

from conftest import REPO

# A path as prose writes it: a top-level folder of the repository, then its parts; `NAME`-like placeholders and
# globs (`bench_*`) are not paths.
PATH = re.compile(r"(?<![\w./-])((?:sparsetx|docs|tests|configs|deploy)/[\w./-]*\w)(?![\w*])")
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z][A-Z_]+(?:\.\w+)?(?:/|$)")


def named_paths() -> dict[str, set[str]]:
  """{path: the files naming it} over sparsetx/**/*.py, the Markdown files and deploy/."""
  sources = [*REPO.glob("sparsetx/**/*.py"), *REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("deploy/**/*")]
  named = {}
  for source in sources:
    if source.is_file():
      for match in PATH.finditer(source.read_text(encoding="utf-8", errors="replace")):
        path = match.group(1).rstrip(".")
        if not PLACEHOLDER.search(path):
          named.setdefault(path, set()).add(str(source.relative_to(REPO)))
  return named


def test_every_named_path_exists():
  named = named_paths()
  assert "sparsetx/data/global_stream.py" in named and "docs/kernels.md" in named  # the scan reads prose
  missing = {path: sorted(where) for path, where in named.items() if not (REPO / path).exists()}
  assert not missing, missing


def test_module_docstrings_are_short():
  """A module docstring says what the module is and why in at most 10 lines; longer notes go to docs/."""
  long = {}
  for source in REPO.glob("sparsetx/**/*.py"):
    doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")), clean=False)
    if doc and len(doc.strip("\n").split("\n")) > 10:
      long[str(source.relative_to(REPO))] = len(doc.strip("\n").split("\n"))
  assert not long, long
