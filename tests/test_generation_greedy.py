"""The oracle: greedy DFlash output == plain greedy, token for token (fp32)."""

import pytest
import torch
from transformers import StoppingCriteriaList

from hf_dflash import DFlashGenerateOutput
from tests.conftest import ARCHITECTURES, make_drafter, make_target
from tests.helpers.generation import Collect, StopAfterToken, oracle_for, plain_greedy, prompt


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 3, 4, 8, 16])
def test_random_drafter_matches_plain_greedy(arch, block_size):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=block_size)
    for seed in range(3):
        input_ids = prompt(seed, length=5 + seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=37)
        actual = target.generate(input_ids, do_sample=False, max_new_tokens=37, assistant_model=drafter)
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 5, 16])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 17, 30])
def test_oracle_drafter_matches_and_accepts_everything(arch, block_size, max_new_tokens):
    target = make_target(arch)
    input_ids = prompt(1)
    drafter = oracle_for(target, input_ids, block_size, max_new_tokens)
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    expected = target.generate(input_ids, **kwargs)
    actual = target.generate(input_ids, assistant_model=drafter, **kwargs)
    assert torch.equal(actual, expected)
    lengths = drafter.last_acceptance.acceptance_lengths
    # max_new_tokens lands inside a block: only the last round may be short, none overshoots
    assert sum(lengths) + 1 == max_new_tokens
    assert all(length == block_size for length in lengths[:-1])


@pytest.mark.parametrize("block_size", [3, 8])
def test_eos_inside_accepted_block_stops_there(block_size):
    target = make_target("qwen3")
    input_ids = prompt(2)
    free_run = plain_greedy(target, input_ids, max_new_tokens=20, eos_token_id=None)
    generated = free_run[0, input_ids.shape[1] :].tolist()
    eos = generated[6]  # a token the target emits mid-way: make it the EOS
    drafter = oracle_for(target, input_ids, block_size, 20)
    expected = plain_greedy(target, input_ids, max_new_tokens=20, eos_token_id=eos)
    actual = target.generate(input_ids, do_sample=False, max_new_tokens=20, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(actual, expected)
    assert actual[0, -1].item() == eos and len(actual[0]) < len(free_run[0])


def test_custom_stopping_criterion_met_mid_block():
    target = make_target("llama")
    input_ids = prompt(3)
    free_run = plain_greedy(target, input_ids, max_new_tokens=24, eos_token_id=None)
    stop_token = free_run[0, input_ids.shape[1] + 9].item()
    criteria = StoppingCriteriaList([StopAfterToken(stop_token, input_ids.shape[1])])
    drafter = oracle_for(target, input_ids, 8, 24)
    kwargs = dict(max_new_tokens=24, eos_token_id=None, stopping_criteria=criteria)
    expected = plain_greedy(target, input_ids, **kwargs)
    actual = target.generate(input_ids, do_sample=False, assistant_model=drafter, **kwargs)
    assert torch.equal(actual, expected)
    assert len(actual[0]) < len(free_run[0])


def test_streamer_receives_exactly_the_committed_tokens():
    target = make_target("llama")
    input_ids = prompt(4)
    drafter = oracle_for(target, input_ids, 4, 21)
    streamer = Collect()
    output = target.generate(input_ids, do_sample=False, max_new_tokens=21, assistant_model=drafter, streamer=streamer)
    streamed = [token for chunk in streamer.chunks for token in chunk]
    assert streamed == output[0].tolist()  # prompt first (put by generate), then each committed chunk
    assert streamer.ended
    assert max(len(chunk) for chunk in streamer.chunks[1:]) > 1  # whole accepted blocks arrive at once


def test_return_dict_scores_logits_and_hidden_states_match_plain():
    target = make_target("qwen2")
    input_ids = prompt(5)
    drafter = oracle_for(target, input_ids, 4, 12)
    kwargs = dict(
        do_sample=False,
        max_new_tokens=12,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        output_hidden_states=True,
        repetition_penalty=1.3,  # a processor that reads input_ids: scores must still match
    )
    expected = target.generate(input_ids, **kwargs)
    actual = target.generate(input_ids, assistant_model=drafter, **kwargs)
    assert isinstance(actual, DFlashGenerateOutput)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == 12
    for mine, theirs in zip(actual.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(actual.logits, expected.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert len(actual.hidden_states) == len(expected.hidden_states)
    for mine, theirs in zip(actual.hidden_states, expected.hidden_states):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert sum(actual.acceptance_lengths) == 11 and max(actual.acceptance_lengths) == 4


def test_acceptance_statistics_of_last_call():
    target = make_target("llama")
    input_ids = prompt(6)
    drafter = oracle_for(target, input_ids, 4, 13)
    target.generate(input_ids, do_sample=False, max_new_tokens=13, assistant_model=drafter)
    stats = drafter.last_acceptance
    assert stats.acceptance_lengths == [4, 4, 4]
    assert stats.mean_acceptance_length == 4.0
    assert stats.histogram == [0, 0, 0, 3]


def test_greedy_with_logits_processors_matches_plain():
    target = make_target("mistral_gqa")
    drafter = make_drafter(target, block_size=6)
    input_ids = prompt(7)
    kwargs = dict(do_sample=False, max_new_tokens=25, repetition_penalty=1.5, no_repeat_ngram_size=3, min_new_tokens=10)
    assert torch.equal(
        target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
    )


def test_greedy_tokens_break_ties_like_argmax():
    from hf_dflash.generation.verifying.acceptance_rules import greedy_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (200, 64), generator=generator).float()  # many ties
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_window_target_rolls_back_rejected_drafts(block_size):
    """A target whose layers use a sliding window (cache cropped past the window) stays lossless."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import COMMON

    torch.manual_seed(0)
    config = MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    target = MistralForCausalLM(config).eval()
    drafter = make_drafter(target, block_size=block_size)
    input_ids = prompt(8, length=9)
    kwargs = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    assert torch.equal(
        target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
    )
