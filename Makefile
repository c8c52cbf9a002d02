# PruneOps: `make run` (venv, install, dvc repro) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# Extra pip arguments for torch, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_INDEX ?=
PYTEST_ARGS ?=

STATE ?= $(abspath state)
PREFECT_PORT ?= 4200

export DVC_NO_ANALYTICS := 1
# Prefect keeps its database and settings inside the project; no analytics.
export PREFECT_HOME := $(STATE)/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test install install-dev repo lint format clean help prefect-server deploy

help:
	@echo "make run    - create $(VENV), install, dvc repro on the embedded default (digits)"
	@echo "make test   - install dev extras, then pytest"
	@echo "make lint   - ruff check + format check"
	@echo "make prefect-server - local Prefect server on 127.0.0.1:$(PREFECT_PORT) (SQLite under state/)"
	@echo "make deploy - serve the pipeline, drift-check (cron) and re-prune (drift event) deployments"

$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0" $(TORCH_INDEX)
	$(PIP) install -q -c constraints.txt -e .
	touch $@

$(BIN)/.installed-dev: $(BIN)/.installed
	$(PIP) install -q -c constraints.txt -e ".[dev,hf,orchestration,serve]"
	touch $@

install: $(BIN)/.installed
install-dev: $(BIN)/.installed-dev

# A checkout without git or DVC metadata (e.g. an unpacked archive) gets both, analytics off.
repo: install
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { git init -q && git add -A && \
		git -c user.name=pruneops -c user.email=pruneops@localhost commit -qm "initial commit"; }
	@test -f .dvc/config || $(BIN)/dvc init -q $$(test -d .git || echo --subdir)
	@$(BIN)/dvc config core.analytics false

run: repo
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro
	@cat artifacts/benchmark/benchmark.md

test: install-dev
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

prefect-server: install-dev
	mkdir -p $(PREFECT_HOME)
	$(BIN)/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

deploy: install-dev repo
	PATH="$(abspath $(BIN)):$$PATH" PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api \
		$(BIN)/python -m flows.deploy --project-dir $(CURDIR)

clean:
	rm -rf artifacts metrics plots .pytest_cache
