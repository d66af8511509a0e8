# The two set-up commands of the README: `make demo` (the main job) and `make test`.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install demo test test-fast lint typecheck bench airflow clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Airflow's install convention: exact versions from the committed constraints file.
	$(BIN)/pip install -q -e ".[dev]" --constraint constraints.txt
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rtrain prepare
	$(BIN)/rtrain train --preset small run_name=demo-cli resume_from=latest \
	    --chaos preempt:worker=1,step=40 --chaos capacity:to=4,step=80

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check training plugins dags tests

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/rtrain bench

clean:
	rm -rf var airflow_home .pytest_cache
