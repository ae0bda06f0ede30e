# Two entry points that work on a fresh machine (network: package registries only).
#   make serve  -> create .venv, install gemmax, serve the built-in default model on 127.0.0.1:8000
#   make test   -> create .venv, install gemmax with test extras, lint, run the test suite
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

.PHONY: install install-test serve test lint
install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test]"

serve: install
	$(BIN)/gemmax serve --host 127.0.0.1 --port $(PORT)

lint: install-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

test: install-test lint
	$(BIN)/python -m pytest -q
