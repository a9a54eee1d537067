# Two commands after cloning: `make demo` (the worked example) and `make test` (the suite).
# Each creates .venv and installs what it needs (torch pinned to the CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements-dev.txt
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit explain

# `test` builds the docs strictly first (a broken reference or a stale docstring fails it), then
# tells pytest the site was just built so tests/test_docs.py does not build it a second time.
test: $(STAMP)
	$(BIN)/ruff check src tests $(wildcard benchmarks examples)
	$(MAKE) docs
	ATTNKIT_DOCS_BUILT=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests $(wildcard benchmarks examples)

# The documentation site (MkDocs + Material + mkdocstrings), strict and offline: build/site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/attnkit bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
