PY ?= python3

.PHONY: install test lint format protos

install:
	$(PY) -m pip install torch==2.13.0 || $(PY) -m pip install torch
	$(PY) -m pip install -e '.[dev]'

test:
	$(PY) -m pytest -q -n 2 tests

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format:
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

protos:
	$(PY) protos/generate.py
