"""What the DFlash loop refuses or bounds before it allocates or decodes: absurd tree sizes, assisted-generation
options that do not apply to a DFlash drafter, prompts without token ids, caches too small for the prompt."""

import pytest
import torch
from transformers import StaticCache

from hf_dflash.caches import cache_keyword
from hf_dflash.generation.options import ASSISTANT_OPTIONS
from hf_dflash.generation.policies.tree_size import MAX_TREE_NODES, TreeDrafting
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import plain_greedy, prompt

GREEDY = dict(do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("block_size", [2, 8])
def test_a_huge_tree_setting_is_bounded_with_a_warning_before_anything_is_allocated(block_size):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=block_size)
    drafter.draft_tree = 10**6  # once: ~1 TB of tree mask and node tables for a block-8 drafter
    bound = 17 if block_size == 2 else MAX_TREE_NODES  # the root + its 16 candidates; else the verification cap
    input_ids = prompt(0)
    with pytest.warns(UserWarning, match=rf"draft_tree = 1000000.*at most {bound} nodes"):
        out = target.generate(input_ids, max_new_tokens=5, assistant_model=drafter, **GREEDY)
    assert torch.equal(out, plain_greedy(target, input_ids, max_new_tokens=5, eos_token_id=None))
    assert max(drafter.last_acceptance.tree_sizes) <= bound
    with pytest.raises(ValueError, match=rf"max_nodes=1000000.*at most {MAX_TREE_NODES} nodes"):
        TreeDrafting(10**6)


# A valid value of each option that is not Transformers' default (what a caller sets on purpose).
SET_ON_PURPOSE = {
    "num_assistant_tokens": 3,
    "num_assistant_tokens_schedule": "heuristic",
    "assistant_confidence_threshold": 0.7,
    "assistant_ensemble_weight": 0.5,
    "assistant_early_exit": 2,
    "assistant_lookbehind": 3,
    "target_lookbehind": 3,
}


def test_every_option_is_tried():
    assert set(SET_ON_PURPOSE) == set(ASSISTANT_OPTIONS)


@pytest.mark.parametrize(("name", "value"), sorted(SET_ON_PURPOSE.items()))
def test_assisted_generation_options_that_do_not_apply_are_refused_by_name(name, value):
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=rf"{name}={value!r} does not apply to a DFlash assistant"):
        target.generate(prompt(0), max_new_tokens=4, assistant_model=drafter, **{name: value}, **GREEDY)


@pytest.mark.parametrize("value", ["3", 0, 2.5])
def test_a_prompt_lookup_setting_that_is_not_a_positive_int_is_refused(value):
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens must be an int >= 1"):
        target.generate(prompt(0), max_new_tokens=4, assistant_model=drafter, prompt_lookup_num_tokens=value, **GREEDY)


def test_inputs_embeds_without_token_ids_is_refused_by_name():
    target = make_target("llama")
    drafter = make_drafter(target)
    embeds = target.get_input_embeddings()(prompt(0))
    with pytest.raises(ValueError, match=r"needs the prompt's token ids \(got inputs_embeds\)"):
        target.generate(inputs_embeds=embeds, max_new_tokens=4, assistant_model=drafter, **GREEDY)


def test_a_static_cache_smaller_than_the_prompt_names_the_size_needed():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    input_ids = prompt(0, length=25)
    cache = StaticCache(config=target.config, max_cache_len=20)
    with pytest.raises(
        ValueError, match=r"StaticCache holds 20 slots and the prompt has 25 tokens.*max_cache_len >= 33"
    ):
        target.generate(
            input_ids, max_new_tokens=4, assistant_model=drafter, **{cache_keyword(target): cache}, **GREEDY
        )
