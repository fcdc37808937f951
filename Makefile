# eyas: `make run` sets up and runs the default job; `make test` runs the tests (CI calls it).
PYTHON ?= python3
# The CPU build lies on disk on these machines; on a GPU machine pass your CUDA torch, e.g.
# `make setup TORCH=torch==2.11.0`.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
VLLM_VERSIONS ?= 0.32.0 0.22.1 0.16.0

.PHONY: setup run test test-fast vllm-envs spec-env
setup: $(VENV)/.eyas-setup

# constraints.txt pins what CI tested (scripts/freeze_constraints.py writes it; torch is not in it).
$(VENV)/.eyas-setup: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

run: setup
	$(BIN)/eyas pipeline

vllm-envs:
	for v in $(VLLM_VERSIONS); do bash scripts/setup_vllm_env.sh $$v || exit 1; done

# speculators==0.9.0 for the checks of benchmarks/quality against its own code
spec-env: setup
	bash scripts/setup_speculators_env.sh

# Two pytest workers, each taking whole test files (their module fixtures are made once): on the
# 2-core CI machine one worker's engine start or subprocess overlaps the other's compute.
PYTEST := $(BIN)/python -m pytest -q -rs -n 2 --dist loadfile

test: setup vllm-envs spec-env
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/ruff check src tests benchmarks scripts
	$(PYTEST)

# Without the vLLM environments and the slow end-to-end tests.
test-fast: setup
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/ruff check src tests benchmarks scripts
	$(PYTEST) -m "not slow and not vllm"
