# NoETL runtime: the two commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test install proto proto-check lint unit integration e2e down status clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

## make run: set up, start the embedded local stack (if not running), run examples/hello_world.yaml
run: install
	@$(BIN)/noetl-rt dev status >/dev/null 2>&1 || $(BIN)/noetl-rt dev up --detach
	@$(BIN)/noetl-rt run examples/hello_world.yaml
	@echo
	@echo "The local stack is still running: '$(BIN)/noetl-rt dev status' shows it, 'make down' stops it."

down: install
	@$(BIN)/noetl-rt dev down

status: install
	@$(BIN)/noetl-rt dev status

## make test: set up and run every check: lint, types, proto, unit, integration, end-to-end
test: install lint proto-check
	$(BIN)/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

unit: install
	$(BIN)/pytest -q -p no:cacheprovider tests/unit

integration: install
	$(BIN)/pytest -q -p no:cacheprovider tests/integration

e2e: install
	$(BIN)/pytest -q -p no:cacheprovider tests/e2e

lint: install
	$(BIN)/ruff check libs services tests scripts
	$(BIN)/mypy libs services
	cd proto && ../$(BIN)/buf lint

proto: install
	$(BIN)/python scripts/gen_proto.py

## the committed generated code must match the protos
proto-check: install
	@$(BIN)/python scripts/gen_proto.py >/dev/null 2>&1
	@git diff --quiet -- libs/noetl_proto || { echo "libs/noetl_proto is stale: run 'make proto' and commit"; git --no-pager diff --stat -- libs/noetl_proto; exit 1; }

clean:
	-$(BIN)/noetl-rt dev down
	rm -rf .noetl .pytest_cache .mypy_cache .ruff_cache
