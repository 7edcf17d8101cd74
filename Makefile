# Every target builds .venv itself from pyproject.toml (a fresh clone needs nothing else).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench faults clean venv

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/sagaworker demo

lint: $(STAMP)
	$(BIN)/ruff check sagaworker tasks config tests
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

faults: $(STAMP)
	FAULT_SCALE=large $(BIN)/pytest tests/faults

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
