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

# The main job: the resilient_training DAG end to end (airflow dags test, Airflow home ./airflow_home,
# SQLite) on the local slice: `small` preset, one host lost at step 40, capacity back at step 80, a
# learning-rate spike at step 105 that validation rejects (rollback branch); then the run's summary.
# Options: make demo DEMO_ARGS="--no-regression" (host loss and capacity only), "--steps N", ...
demo: $(STAMP)
	$(BIN)/python .ci/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check training plugins dags tests

typecheck: $(STAMP)
	$(BIN)/mypy

# The UI: airflow standalone on 127.0.0.1:$(AIRFLOW_PORT), DAGs unpaused; prints the admin password.
AIRFLOW_PORT ?= 8080
airflow: $(STAMP)
	$(BIN)/python .ci/airflow_ui.py --port $(AIRFLOW_PORT)

bench: $(STAMP)
	$(BIN)/rtrain bench

clean:
	rm -rf var airflow_home .pytest_cache
