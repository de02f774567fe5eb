# Every target does its own set-up: a fresh machine needs nothing but python3.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here, not in pyproject: on these machines 2.13.0 resolves to a local CPU
# wheel. A GPU machine runs `make TORCH_SPEC="torch==2.13.0 --index-url <cuda index>" install`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvledger demo

test: $(STAMP)
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python ops/bench/projector.py
	$(BIN)/python ops/bench/log.py

lint: $(STAMP)
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) build *.egg-info

# The separate vLLM environment for issue 9 (about 3.4 GB; see ops/vllm/setup.sh).
.PHONY: vllm-env
.venv-vllm/.installed: ops/vllm/setup.sh
	ops/vllm/setup.sh

vllm-env: .venv-vllm/.installed
