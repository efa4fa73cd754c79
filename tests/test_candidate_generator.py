"""`DFlashCandidateGenerator` serves Transformers' own assisted loop (its CandidateGenerator contract):
greedy output == plain greedy token for token (fp32), and it drafts what our loop drafts."""

import pytest
import torch

from tests.conftest import ARCHITECTURES, make_drafter, make_target
from tests.helpers.generation import oracle_for, prompt


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_transformers_loop_with_our_generator_matches_plain_greedy(
    arch, block_size, our_generator_in_transformers_loop
):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=block_size)
    for seed in range(2):
        input_ids = prompt(seed, length=5 + seed)
        kwargs = dict(do_sample=False, max_new_tokens=29, eos_token_id=None)
        expected = target.generate(input_ids, **kwargs)
        actual = target.generate(input_ids, assistant_model=drafter, speculation_type="dflash", **kwargs)
        assert torch.equal(actual, expected)
        target.generate(input_ids, assistant_model=drafter, **kwargs)  # our loop, same drafter
        assert (
            our_generator_in_transformers_loop[-1].stats.acceptance_lengths
            == drafter.last_acceptance.acceptance_lengths
        )


def test_oracle_drafts_whole_blocks_in_transformers_loop(our_generator_in_transformers_loop):
    target = make_target("qwen3")
    input_ids = prompt(1)
    drafter = oracle_for(target, input_ids, block_size=4, max_new_tokens=21)
    kwargs = dict(do_sample=False, max_new_tokens=21, eos_token_id=None)
    actual = target.generate(input_ids, assistant_model=drafter, speculation_type="dflash", **kwargs)
    assert torch.equal(actual, target.generate(input_ids, **kwargs))
    stats = our_generator_in_transformers_loop[-1].stats
    assert stats.acceptance_lengths[:-1] == [4] * (len(stats.acceptance_lengths) - 1)
    assert sum(stats.acceptance_lengths) + 1 == 21
