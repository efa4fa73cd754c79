# hf-dflash: `make demo` runs the main job, `make test` runs the test suite.
# Both create ./.venv on first use (torch 2.13.0 CPU build, then the package with its extras).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,real]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-dflash demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

clean:
	rm -rf $(VENV) .pytest_cache
