# Two commands after cloning: `make demo` (the worked example) and `make test` (the suite).
# Each creates .venv and installs what it needs (torch pinned to the CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements-dev.txt
	$(BIN)/pip install --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit explain

test: $(STAMP)
	$(BIN)/ruff check src tests $(wildcard benchmarks examples)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests $(wildcard benchmarks examples)

bench: $(STAMP)
	$(BIN)/attnkit bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
