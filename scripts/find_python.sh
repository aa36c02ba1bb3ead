#!/usr/bin/env sh
# Prints an interpreter for the project's .venv (Python 3.12 or 3.13, as pyproject.toml requires): the first that runs of
# python3.12, python3.13 and python3 on the PATH, else a pyenv build under $(pyenv root)/versions (pyenv's shims refuse
# a version the current directory does not select, so the build itself is run). Exits 1 with one line when none exists.
for candidate in python3.12 python3.13 python3 \
  "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12 \
  "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.13*/bin/python3.13; do
  found=$("$candidate" -c 'import sys; print(sys.executable if (3, 12) <= sys.version_info[:2] <= (3, 13) else "")' 2>/dev/null) || continue
  if [ -n "$found" ]; then echo "$found"; exit 0; fi
done
echo "error: sparsetx needs Python 3.12 or 3.13 and found neither on the PATH nor under pyenv; install one (e.g. 'pyenv install 3.12', or your system's python3.12 package) or run make with PYTHON=/path/to/python3.12" >&2
exit 1
