# The README's commands. Each target installs what it needs into .venv first, so they work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# A CPU-only machine gets torch's CPU build first, so pip never resolves a multi-GB CUDA build there.
TORCH_CPU := torch==2.13.0

.PHONY: run test lint browser-deps clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q $(TORCH_CPU); fi
	$(BIN)/pip install -q -e '.[server,console]'
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

## lint: formatting and lint, as CI checks them; the Dockerfile and the entrypoint too (warnings fail)
lint: $(DEV_STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/hadolint --failure-threshold warning Dockerfile
	$(BIN)/shellcheck bin/flashgate

# Browser tests drive Debian's chromium (Playwright never downloads a browser of its own here).
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "could not install chromium: browser tests will be skipped"; \
	else echo "chromium is missing: run 'sudo apt-get install chromium' for the browser tests (skipped until then)"; fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
