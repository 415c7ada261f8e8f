# NoETL runtime: the two commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test install proto proto-check proto-breaking lint unit integration e2e down status clean

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
	$(BIN)/ruff check libs services clients tests scripts
	$(BIN)/mypy libs services clients/python
	cd proto && ../$(BIN)/buf lint

proto: install
	$(BIN)/python scripts/gen_proto.py

## the committed generated code must match the protos
proto-check: install
	@$(BIN)/python scripts/gen_proto.py >/dev/null 2>&1
	@git diff --quiet -- clients/python/noetl_proto || { echo "clients/python/noetl_proto is stale: run 'make proto' and commit"; git --no-pager diff --stat -- clients/python/noetl_proto; exit 1; }

## make proto-breaking [PROTO_BASE=REF]: buf's breaking-change check of proto/ against a git ref
## (default main); the breaks accepted on purpose are recorded in proto/BREAKING.md
PROTO_BASE ?= main
proto-breaking: install
	$(BIN)/buf breaking proto --against '.git#ref=$(PROTO_BASE),subdir=proto'

clean:
	-$(BIN)/noetl-rt dev down
	rm -rf .noetl .pytest_cache .mypy_cache .ruff_cache

# ---------------------------------------------------------------- deployment (docs/DEPLOY.md)
# Images: one per role from the root Dockerfile (a target per role), tagged
# $(IMAGE_REPOSITORY)-<role>:$(IMAGE_TAG), as the Helm chart expects. scripts/images.sh picks
# the engine (ENGINE=auto: Docker when it reaches an engine, else podman, else buildah), the
# base (PYTHON_IMAGE, default python:3.11-slim-bookworm; without a registry, podman builds
# on a local Debian bookworm base, deploy/docker/base-image.sh) and whether the build asks
# a package index (OFFLINE=1: wheels fetched on the host into deploy/docker/wheelhouse/).
IMAGE_REPOSITORY ?= noetl-runtime
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
IMAGE_ROLES := api shard-manager projector checkpointer compactor reaper worker
ENGINE ?= auto
DOCKER ?= docker
DOCKER_BUILD_ARGS ?=
PYTHON_IMAGE ?=
OFFLINE ?=
IMAGES_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: images base-image check-images deploy-tools dashboards chart-files check-deploy

## make images: build the seven role images with Docker, podman or buildah (DRY_RUN=1 only prints the
## commands; OFFLINE=1: pip in the build asks no index). With no engine it says so and fails.
images:
	@ENGINE="$(ENGINE)" DOCKER="$(DOCKER)" IMAGE_REPOSITORY="$(IMAGE_REPOSITORY)" IMAGE_TAG="$(IMAGE_TAG)" \
	  DOCKER_BUILD_ARGS="$(DOCKER_BUILD_ARGS)" PYTHON_IMAGE="$(PYTHON_IMAGE)" OFFLINE="$(OFFLINE)" \
	  DRY_RUN="$(DRY_RUN)" PYTHON="$(IMAGES_PYTHON)" bash scripts/images.sh

## make base-image: the local base image (debootstrap bookworm + python3, imported with podman as
## localhost/noetl-base:bookworm), for building without a registry; kept until removed (FORCE=1 remakes it)
base-image:
	sh deploy/docker/base-image.sh

## make check-images: build the seven images with podman (the local base when no registry answers) and
## check them for real: entry point, uid, no compiler/pip/source; then the seven roles run from their
## mounted images (chroot as uid 10001) against a local Postgres and NATS and run a playbook (as root)
check-images: install
	$(MAKE) --no-print-directory images ENGINE=podman
	NOETL_CHECK_IMAGES=1 IMAGE_REPOSITORY="$(IMAGE_REPOSITORY)" IMAGE_TAG="$(IMAGE_TAG)" \
	  $(BIN)/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests/deploy/test_images.py

## make deploy-tools: helm, kubernetes-validate, hadolint, CRD validators (into .tools/), prometheus/promtool (apt)
deploy-tools:
	@bash scripts/deploy_tools.sh

## make dashboards: regenerate deploy/helm/noetl/dashboards/*.json (scripts/gen_dashboards.py)
dashboards: install
	$(BIN)/python scripts/gen_dashboards.py

## make chart-files: regenerate the chart's README (from values.schema.json), lite mode's NATS users and
## deploy/helm/examples/nats-values.yaml (from the runtime's NATS permissions): scripts/gen_chart_files.py
chart-files: install
	$(BIN)/python scripts/gen_chart_files.py

## make check-deploy: Dockerfile, Helm chart (lint, render, Kubernetes/CRD schemas), alerts (promtool),
## and every dashboard/alert expression against a real Prometheus scraping a local stack
check-deploy: install deploy-tools
	NOETL_CHECK_DEPLOY=1 $(BIN)/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests/deploy

# ---------------------------------------------------------------- benchmarks (bench/, docs/BENCHMARKS.md)
.PHONY: bench bench-quick
BENCH_ARGS ?=

## make bench: every scenario, the fsync-on re-run, Temporal and Prefect side by side, plots -> docs/BENCHMARKS.md
## (the peers and matplotlib go into bench-only virtualenvs, bench/.venv-*; the project's dependencies stay as they are)
bench: install
	$(BIN)/python -m bench --full --command "make bench" $(BENCH_ARGS)

## make bench-quick: the short run (< 3 min on a quiet machine): smaller sizes, no peers -> docs/BENCHMARKS.md
bench-quick: install
	$(BIN)/python -m bench --quick --command "make bench-quick" $(BENCH_ARGS)
