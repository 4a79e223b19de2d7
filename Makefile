# pushgw: two commands on a fresh machine with only python3 (and Java 17 for Spark).
#   make serve   run the gateway with the provider simulators (config/local.yaml)
#   make test    lint, type-check and run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: serve test lint typecheck unit bench clean java-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Reinstall whenever pyproject.toml changes.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[relay]'
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,spark]'
	touch $@ $(VENV)/.runtime

serve: $(VENV)/.runtime
	$(BIN)/pushgw serve --config config/local.yaml --with-simulators var/simulators

java-check:
	@java -version >/dev/null 2>&1 || { \
	  echo "Java 17+ is required by the Spark jobs and their tests."; \
	  echo "Install it with: apt-get install openjdk-17-jre-headless (Debian/Ubuntu),"; \
	  echo "or set JAVA_HOME to a JDK 17 installation."; exit 1; }
	@java -version 2>&1 | head -1 | grep -Eq '"(1[7-9]|[2-9][0-9])' || { \
	  echo "Spark needs Java 17 or newer; found: $$(java -version 2>&1 | head -1)"; exit 1; }

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.dev
	$(BIN)/mypy

unit: $(VENV)/.dev java-check
	$(BIN)/pytest

test: lint typecheck unit

bench: $(VENV)/.dev
	$(BIN)/python bench/delivery.py

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
