# The README's commands. Each target installs what it needs into .venv first, so they work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# A CPU-only machine gets torch's CPU build first, so pip never resolves a multi-GB CUDA build there.
CPU_TORCH_VERSION := 2.13.0
TORCH_CPU := torch==$(CPU_TORCH_VERSION)

# The image (Dockerfile). Its defaults are the production build: the CUDA base on Ubuntu 24.04 (Python 3.12) and
# torch 2.11.0 from PyPI. `make wheelhouse` downloads every wheel that build installs into wheelhouse/ (inside the
# build context) for a build with no index: `--build-arg WHEELHOUSE=1`. Override the four below for another pairing.
IMAGE ?= flashgate:local
WHEELHOUSE_PYTHON ?= 3.12
TORCH_VERSION ?= 2.11.0
TRITON_VERSION ?= 3.6.0
TORCH_INDEX_URL ?= https://pypi.org/simple
# CI's CPU build of the same Dockerfile: a Debian 12 root made with mmdebstrap holding Debian's Python 3.11 and the
# compiler Triton needs (each pinned to its Debian 12 release series), and torch's CPU wheel.
DEBIAN12_BASE ?= flashgate-base:debian12
DEBIAN12_PYTHON := python3.11
DEBIAN12_PACKAGES := python3.11=3.11.2-6+deb12u* python3.11-venv=3.11.2-6+deb12u* python3.11-dev=3.11.2-6+deb12u* \
	gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u*
# pip download takes each platform tag literally (no older manylinux implied): every glibc level up to Debian 12's 2.36.
WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
FLASHGATE_COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)

.PHONY: run test lint browser-deps clean wheelhouse base-debian12 image-cpu image-docker-proxy

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Not quiet: a first install takes minutes, and pip's own lines (each package, its download) are the progress.
$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "Installing the engine and the console into $(VENV) (first use only; a few minutes)"
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "No NVIDIA GPU: torch's CPU build first ($(TORCH_CPU))"; $(BIN)/pip install $(TORCH_CPU); fi
	$(BIN)/pip install -e '.[server,console]'
	@touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q -e '.[server,console,dev]'
	@touch $@

## run: the appliance on its embedded defaults (console on 127.0.0.1:8080, SQLite in ./data, CPU demo profile),
## through the container's entrypoint
run: $(RUN_STAMP)
	FLASHGATE_PYTHON=$(BIN)/python sh bin/flashgate console

## test: the whole suite, with per-marker time budgets and the slowest tests listed
test: $(DEV_STAMP) browser-deps
	$(BIN)/python -m pytest --durations=25

## lint: formatting and lint, as CI checks them; the Dockerfile, the entrypoint and CI's scripts too (warnings fail)
lint: $(DEV_STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/hadolint --failure-threshold warning Dockerfile deploy/docker-proxy/Dockerfile
	$(BIN)/shellcheck bin/flashgate .ci/run .ci/dockerd

# Browser tests drive Debian's chromium (Playwright never downloads a browser of its own here).
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "could not install chromium: browser tests will be skipped"; \
	else echo "chromium is missing: run 'sudo apt-get install chromium' for the browser tests (skipped until then)"; fi

## wheelhouse: every wheel the image installs, for WHEELHOUSE_PYTHON and TORCH_VERSION, into wheelhouse/ (needs a
## network; the build that uses it does not)
wheelhouse: $(RUN_STAMP)
	$(BIN)/python deploy/requirements.py > wheelhouse/.requirements.txt
	$(BIN)/python -m pip download --quiet --only-binary=:all: --dest wheelhouse \
		--python-version $(WHEELHOUSE_PYTHON) $(WHEEL_PLATFORMS:%=--platform %) --extra-index-url $(TORCH_INDEX_URL) \
		torch==$(TORCH_VERSION) triton==$(TRITON_VERSION) -r wheelhouse/.requirements.txt 'setuptools>=69'
	@ls wheelhouse/*.whl | wc -l | xargs printf 'wheelhouse/: %s wheels, '; du -sh wheelhouse | cut -f1

## base-debian12: the Debian 12 base image CI builds on, made with mmdebstrap and `docker import` (no registry)
base-debian12:
	@if docker image inspect $(DEBIAN12_BASE) >/dev/null 2>&1; then echo "$(DEBIAN12_BASE) is there"; else \
		mmdebstrap --quiet --variant=minbase \
			--include="$$(printf '%s\n' $(DEBIAN12_PACKAGES) | cut -d= -f1 | paste -sd,)" bookworm - \
			| docker import --message "mmdebstrap bookworm minbase" - $(DEBIAN12_BASE); fi

## image-cpu: the image on the Debian 12 base from the wheelhouse, with no network at all (CI's build)
image-cpu: base-debian12
	$(MAKE) wheelhouse WHEELHOUSE_PYTHON=3.11 TORCH_VERSION=$(CPU_TORCH_VERSION)
	docker build --network none --tag $(IMAGE) \
		--build-arg BASE_IMAGE=$(DEBIAN12_BASE) --build-arg PYTHON=$(DEBIAN12_PYTHON) \
		--build-arg SYSTEM_PACKAGES="$(DEBIAN12_PACKAGES)" \
		--build-arg TORCH_VERSION=$(CPU_TORCH_VERSION) --build-arg WHEELHOUSE=1 \
		--build-arg FLASHGATE_COMMIT=$(FLASHGATE_COMMIT) .

## image-docker-proxy: the docker driver's socket proxy (deploy/docker-proxy/, Debian's haproxy) on the Debian 12 base
image-docker-proxy: base-debian12
	docker build --tag flashgate-docker-proxy:local --build-arg BASE_IMAGE=$(DEBIAN12_BASE) deploy/docker-proxy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
