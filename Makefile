# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Python 3.12: on PATH, or pyenv's (whose shim answers only when 3.12 is the selected version).
ifeq ($(origin PY),undefined)
PY      := $(firstword $(foreach p,python3.12 $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12),$(shell $(p) -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $(p))))
endif
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: test-all install demo test test-fast check lint format typecheck imports sizes chaos bench airflow clean

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PY)" || { echo "need Python 3.12 (python3.12 on PATH, or pyenv's 3.12), or PY=/path/to/python3.12"; exit 1; }
	# A venv of another Python (the project was on 3.11) is made anew.
	$(BIN)/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || { rm -rf $(VENV); $(PY) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	# Airflow's install convention: exact versions from the committed constraints file.
	$(BIN)/pip install -q -e ".[dev]" --constraint constraints.txt
	touch $(STAMP)

install: $(STAMP)

# The main job: the resilient_training DAG end to end (airflow dags test, Airflow home ./airflow_home,
# SQLite) on the local slice: `small` preset, one host lost at step 41, capacity back at step 80, a
# learning-rate spike at step 105 that validation rejects (rollback branch); then the run's summary.
# Options: make demo DEMO_ARGS="--no-regression" (host loss and capacity only), "--steps N", ...
demo: $(STAMP)
	$(BIN)/python .ci/demo.py $(DEMO_ARGS)

# The README's test command (and CI's): style, types, the import layering, then the fast tests, then the slow
# ones (real multi-process jobs, Airflow runs, an API server, a browser, the README's own commands): about
# 30 minutes on 2 cores.  The extended scenarios (the longest end-to-end runs, gs:// runs against the emulator,
# reruns, parity, whole slices, the chaos seeds) take about 45 minutes more: `make test-all` runs everything.
test: check
	$(BIN)/python -m pytest -q -m "not slow"
	$(BIN)/python -m pytest -q -m "slow and not extended" --durations=12

test-all: check
	$(BIN)/python -m pytest -q -m "not slow"
	$(BIN)/python -m pytest -q -m "slow" --durations=12

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

check: lint typecheck imports sizes

lint: $(STAMP)
	$(BIN)/ruff check training benchmarks plugins dags tests examples .ci
	$(BIN)/ruff format --check training benchmarks plugins dags tests examples .ci

format: $(STAMP)
	$(BIN)/ruff format training benchmarks plugins dags tests examples .ci

# mypy: the engine strictly, the Airflow side, and the tests (each test folder on its own: they share module
# names).  In tests, Optional reads that are indexed at once and the loose typing of Airflow's and protobuf's
# test doubles are not reported (a None there fails the test loudly anyway).
TESTS_MYPY := $(BIN)/mypy --config-file pyproject.toml --disable-error-code index --disable-error-code union-attr \
	--disable-error-code typeddict-item --disable-error-code arg-type --disable-error-code assignment --no-warn-unused-ignores
typecheck: $(STAMP)
	$(BIN)/mypy
	$(TESTS_MYPY) tests/test_storage.py tests/test_readme.py tests/test_sizes.py tests/test_architecture_map.py tests/conftest.py
	MYPYPATH=tests/training:plugins $(TESTS_MYPY) tests/training
	MYPYPATH=tests/dags:plugins $(TESTS_MYPY) tests/dags
	MYPYPATH=tests/dags:plugins $(TESTS_MYPY) tests/plugins

# dags -> plugins -> training.api -> training.* (contracts in pyproject.toml).
imports: $(STAMP)
	PYTHONPATH=plugins $(BIN)/lint-imports

# The size limits: no module over 800 lines, class over 300 or function over 80, in every folder of code,
# checked with a tenth of each kept as room (720, 270, 72).
sizes: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_sizes.py

# The chaos suite over more seeds (3 run in `make test-all`).
SEEDS ?= 20
chaos: $(STAMP)
	RTRAIN_CHAOS_SEEDS=$(SEEDS) $(BIN)/python -m pytest -q -m chaos

# The UI: airflow standalone on 127.0.0.1:$(AIRFLOW_PORT), DAGs unpaused; prints the admin password.
AIRFLOW_PORT ?= 8080
airflow: $(STAMP)
	$(BIN)/python .ci/airflow_ui.py --port $(AIRFLOW_PORT)

bench: $(STAMP)
	$(BIN)/rtrain bench

clean:
	rm -rf var airflow_home .pytest_cache
