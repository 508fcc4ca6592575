# Two commands on a fresh machine with python3 and pip: `make repro` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
# glibc's malloc advises huge pages for XLA's step buffers (src/stagelm/infra/hugepages.py says
# why); set here, stage processes need not restart themselves to get it. A setting of
# glibc.malloc.hugetlb already in the environment is kept.
ifeq ($(findstring glibc.malloc.hugetlb,$(GLIBC_TUNABLES)),)
export GLIBC_TUNABLES := $(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1
endif

.PHONY: setup repro test docs lint check clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,serve,serve-test,test]'
	touch $@

repro: setup
	dvc repro

# Two xdist workers (one per core): most of the suite's time is single-threaded (stage
# processes starting, DVC, XLA compiles). --dist loadfile keeps each test file on one
# worker, so a module's session fixtures (the DVC tests' built micro project) are built once.
# The tests run lm-eval too (the eval extra, which `make repro` does not need).
$(VENV)/.installed-eval: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[eval]'
	touch $@

test: setup $(VENV)/.installed-eval
	pytest -q -n 2 --dist loadfile --durations=15

# The docs as HTML: warnings are errors, and so is a reference that does not resolve (-n),
# so a broken link, a bad anchor or a page outside the toctree fails the build.
docs: setup
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	sphinx-build -W --keep-going -n -q docs docs/_build/html

lint: setup
	ruff check . && ruff format --check .

check: setup
	stagelm check

clean-venv:
	rm -rf $(VENV)
