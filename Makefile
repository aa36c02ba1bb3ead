# Both targets set up .venv on first use (and again whenever pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: train test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

train: $(VENV)/.installed
	$(PY) -m sparsetx.models.ladder

test: $(VENV)/.installed
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV)
