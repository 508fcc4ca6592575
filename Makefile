# Two commands on a fresh machine with python3 and pip: `make repro` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)

.PHONY: setup repro test lint check clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

repro: setup
	dvc repro

test: setup
	pytest -q --durations=15

lint: setup
	ruff check . && ruff format --check .

check: setup
	stagelm check

clean-venv:
	rm -rf $(VENV)
