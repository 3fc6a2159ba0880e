# Two commands, on a fresh machine with Python 3.10+:
#   make demo   set up .venv with what the demo needs (torch first, then attnkit[viz]) and run
#               `attnkit demo`
#   make test   add the dev tools (pytest, ruff, mypy, mkdocs, triton, transformers, ...), build
#               the docs and run the test suite (sets up .venv first if needed)
#   make docs   build the documentation site into site/ (mkdocs --strict: warnings are errors;
#               nothing is fetched from the network)
#   make fuzz   every hypothesis test with FUZZ_EXAMPLES (1000) random examples (under an
#               hour on 2 cores; not part of `make test`)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test docs lint setup clean fuzz

# what `attnkit demo` needs: torch, attnkit's dependencies, matplotlib for the pictures
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[viz]"
	touch $@

# what the tests and the linters need on top
$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.dev-installed

demo: $(VENV)/.installed
	$(VENV)/bin/attnkit demo

test: $(VENV)/.dev-installed
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(MAKE) --no-print-directory docs
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -m "not slow"

FUZZ_EXAMPLES ?= 1000
fuzz: $(VENV)/.dev-installed
	ATTNKIT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -n 2 --dist loadfile -q \
		-m "hypothesis and not slow"

docs: $(VENV)/.dev-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

lint: $(VENV)/.dev-installed
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m ruff format --check src tests

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
