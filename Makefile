# Everything runs in a virtual environment of its own (VENV), created on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The list type

.PHONY: install up test test-fast test-api-servers lint check format protos

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 is the CPU build where a local wheel exists; elsewhere PyPI's torch.
	$(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The main job: both services with the embedded model, a streamed generation, then serving until Ctrl-C.
up: install
	$(VENV)/bin/tandem up --prompt "$(PROMPT)"

# The test command (what .ci/run calls): lint, then the whole suite.
check: lint test

test: install
	$(PY) -m pytest -q -n 2 tests

# The tests not marked slow (no service processes, no long model runs): under 3 minutes on 2 cores.
test-fast: install
	$(PY) -m pytest -q -n 2 -m "not slow" tests

# The process-level tests against a scheduler split into its engine core and two API servers.
test-api-servers: install
	TANDEM_API_SERVER_COUNT=2 $(PY) -m pytest -q -n 2 tests/test_e2e_services.py tests/test_reliability.py \
		tests/test_exclusive_ports.py tests/test_executor_owner.py tests/test_request_limits.py \
		tests/test_client_cli.py tests/test_executor_security.py tests/test_http_api.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

protos: install
	$(PY) protos/generate.py
