# Two commands, on a fresh machine with Python 3.10+:
#   make demo   set up .venv (torch first, then attnkit and its dev tools) and run `attnkit demo`
#   make test   run the test suite (sets up .venv first if needed)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint setup clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/attnkit demo

test: $(VENV)/.installed
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m pytest -n 2 -q -m "not slow"

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m ruff format --check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
