# Both targets set up .venv on first use (and again whenever pyproject.toml changes).
# Python 3.12 or 3.13 (pyproject.toml's requires-python): found on the PATH or under pyenv by scripts/find_python.sh.
PYTHON ?= $(shell scripts/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdir/tiny

.PHONY: train test test-long lint clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { scripts/find_python.sh; exit 1; }
	$(PY) -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# The tiny sgatlin model on the embedded corpus; run it again to resume (or finish) in $(WORKDIR).
train: $(VENV)/.installed
	$(PY) -m sparsetx.train --config=configs/tiny.py --workdir=$(WORKDIR)
	@echo "Checkpoints: $(WORKDIR)/checkpoints  TensorBoard: tensorboard --logdir $(WORKDIR)/tensorboard  Metrics: $(WORKDIR)/metrics.jsonl"

# 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS); two workers for the two cores.
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 -m "not long" tests

# The system cases of minutes each (several processes training, a whole sweep); CI runs them after `make test`.
test-long: $(VENV)/.installed
	$(PY) -m pytest -n 2 -m long tests

# The house style (pyproject.toml [tool.ruff]); `ruff format .` and `ruff check --fix .` repair most of it.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
