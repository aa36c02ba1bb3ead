# Each target sets up .venv on first use (and again whenever pyproject.toml changes), with what it needs: `make train`
# the package alone (CPU JAX; TensorFlow comes with seqio), the others the `test` extra on top (the CUDA and TPU
# compilers, PyTorch, transformers, lm-eval, ruff). Sizes and times as measured: README.md, its first section.
# Python 3.12 or 3.13 (pyproject.toml's requires-python): found on the PATH or under pyenv by scripts/find_python.sh.
PYTHON ?= $(shell scripts/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdir/tiny

.PHONY: train test test-long lint clean

# A .venv of Python 3.12 or 3.13 with a current pip (another interpreter's .venv is replaced).
define make_venv
	@test -n "$(PYTHON)" || { scripts/find_python.sh; exit 1; }
	@$(PY) -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	@$(PY) -m pip install --quiet --upgrade pip
endef

# The package and what the tiny job needs: the main job's install.
$(VENV)/.installed-train: pyproject.toml
	@echo "Installing sparsetx into .venv (CPU JAX, TensorFlow, Ray, ...): 3.6 GB, usually 2-3 minutes (more without pip's cache)."
	$(make_venv)
	@$(PY) -m pip install --quiet -e .
	@touch $@

# The test extra on top (a .venv from `make train` gets it too): what `make test`, `make test-long` and `make lint` run.
$(VENV)/.installed-test: pyproject.toml
	@echo "Installing sparsetx with its test extra into .venv (adds CUDA and TPU compilers, PyTorch, transformers, ruff): 14 GB in all, usually 4-15 minutes (more without pip's cache)."
	$(make_venv)
	@$(PY) -m pip install --quiet -e '.[test]'
	@touch $@ $(VENV)/.installed-train

# The tiny sgatlin model on the embedded corpus; run it again to resume (or finish) in $(WORKDIR).
train: $(VENV)/.installed-train
	$(PY) -m sparsetx.train --config=configs/tiny.py --workdir=$(WORKDIR)
	@echo "Checkpoints: $(WORKDIR)/checkpoints  TensorBoard: .venv/bin/tensorboard --logdir $(WORKDIR)/tensorboard  Metrics: $(WORKDIR)/metrics.jsonl"

# 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS); two workers for the two cores.
test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m "not long" tests

# The system cases of minutes each (several processes training, a whole sweep); CI runs them after `make test`.
test-long: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m long tests

# The house style (pyproject.toml [tool.ruff]); `ruff format .` and `ruff check --fix .` repair most of it.
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
