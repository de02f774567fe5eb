# Every target does its own set-up: a fresh machine needs nothing but python3.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here, not in pyproject: on these machines 2.13.0 resolves to a local CPU
# wheel. A GPU machine runs `make TORCH_SPEC="torch==2.13.0 --index-url <cuda index>" install`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# What setup.py needs to compile the pure core: pyproject.toml's [build-system] requires, which
# an isolated build would install for itself, here in the venv for the in-place build below.
BUILD_REQUIRES := "setuptools>=68" wheel "cython>=3.1"

.PHONY: install run test bench lint clean

$(STAMP): pyproject.toml Makefile setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC) $(BUILD_REQUIRES)
	# Compiling nothing here (KVLEDGER_PURE_PYTHON=1): the rule below compiles the core in place.
	KVLEDGER_PURE_PYTHON=1 $(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test]'
	touch $(STAMP)

# The pure core compiled with Cython (setup.py), again whenever one of its modules changed (a
# couple of seconds a module): until then an edited module runs as Python (coordinator/_compiled.py).
CORE_SOURCES := $(filter-out coordinator/core/__init__.py,$(wildcard coordinator/core/*.py))
COMPILED := $(VENV)/.compiled
$(COMPILED): $(STAMP) setup.py $(CORE_SOURCES)
	$(BIN)/python setup.py --quiet build_ext --inplace --parallel $(shell nproc)
	touch $(COMPILED)

install: $(STAMP) $(COMPILED)

run: $(STAMP) $(COMPILED)
	$(BIN)/kvledger demo

test: $(STAMP) $(COMPILED) test-tools lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# What some tests need beside the main venv, each built once and reused: the vLLM environment
# (tests/vllm/test_vllm_*.py; about 3.4 GB, 2-4 minutes the first time), promtool
# (tests/ops/test_ops.py) and a Mooncake Store (tests/gpu/test_mooncake_tier.py; about 350 MB).
# A machine where one cannot be built still runs the rest: those tests skip, saying why; CI sets
# KVLEDGER_REQUIRE_VLLM=1, KVLEDGER_REQUIRE_PROMTOOL=1 and KVLEDGER_REQUIRE_MOONCAKE=1 (.ci/run),
# so there they fail instead.
.PHONY: test-tools promtool mooncake
test-tools: $(STAMP)
	@$(MAKE) --no-print-directory vllm-env || echo "make test: the vLLM environment could not be built; its tests will skip with the reason"
	@$(MAKE) --no-print-directory promtool || echo "make test: promtool could not be installed; tests/ops/test_ops.py will skip its rule checks"
	@$(MAKE) --no-print-directory mooncake || echo "make test: the Mooncake Store could not be installed; its tests will skip with the reason"

promtool:
	sh ops/tools/install-promtool.sh

mooncake: $(STAMP)
	sh ops/tools/install-mooncake.sh $(BIN)/python

bench: $(STAMP) $(COMPILED)
	$(BIN)/python ops/bench/projector.py
	$(BIN)/python ops/bench/log.py

# Types, lint, format and the import floors (pyproject.toml, [tool.importlinter]).
lint: $(STAMP)
	$(BIN)/python -m mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .venv-vllm .tools build *.egg-info coordinator/core/*.so coordinator/core/_compiled.json

# The separate vLLM environment for issue 9 (about 3.4 GB; see ops/vllm/setup.sh); `make test` builds it.
.PHONY: vllm-env
.venv-vllm/.installed: ops/vllm/setup.sh
	ops/vllm/setup.sh

vllm-env: .venv-vllm/.installed
