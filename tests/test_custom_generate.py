"""DFlash with plain Transformers: `custom_generate/generate.py` of a drafter folder (a verbatim copy of
hf_dflash/modeling_dflash/custom_generate.py). The loop is called here as the callable Transformers accepts
(`custom_generate=dflash_decoding`, as the folder's `generate` calls it), and once through a folder; the
run with hf_dflash unimportable on the real target is in test_shipped_drafter.py."""

import math

import pytest
import torch
from transformers import StoppingCriteriaList

from hf_dflash.checkpoints import CUSTOM_GENERATE_FILE, save_hub
from hf_dflash.checkpoints import hub as hub_module
from hf_dflash.checkpoints.hub import CUSTOM_GENERATE_SOURCE, check_remote_code
from hf_dflash.modeling_dflash.custom_generate import dflash_decoding
from tests.conftest import ARCHITECTURES, make_drafter, make_target
from tests.helpers.generation import (
    ALPHA,
    Collect,
    StopAfterToken,
    chi_square_against,
    oracle_for,
    plain_greedy,
    prompt,
    second_token_marginal,
)


def dflash(target, input_ids, drafter, **kwargs):
    return target.generate(input_ids, custom_generate=dflash_decoding, dflash_drafter=drafter, **kwargs)


class CountForwards:
    """Counts the target's forward passes (prefill + one per verification round)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self.count)

    def count(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [3, 16])
def test_random_drafter_matches_plain_greedy(arch, block_size):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=block_size)
    input_ids = prompt(block_size, length=6)
    expected = plain_greedy(target, input_ids, max_new_tokens=37)
    assert torch.equal(dflash(target, input_ids, drafter, do_sample=False, max_new_tokens=37), expected)


@pytest.mark.parametrize("block_size", [2, 5, 16])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 17, 30])
def test_oracle_drafter_matches_and_accepts_every_draft(block_size, max_new_tokens):
    """An always-right drafter: every round commits a whole block, and no draft goes past max_length."""
    target = make_target("qwen3")
    input_ids = prompt(1)
    drafter = oracle_for(target, input_ids, block_size, max_new_tokens)
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    expected = target.generate(input_ids, **kwargs)
    counter = CountForwards(target)
    assert torch.equal(dflash(target, input_ids, drafter, **kwargs), expected)
    assert counter.calls == 1 + math.ceil((max_new_tokens - 1) / block_size)  # the prefill, then full blocks


@pytest.mark.parametrize("block_size", [3, 8])
def test_eos_inside_accepted_block_stops_there(block_size):
    target = make_target("qwen3")
    input_ids = prompt(2)
    free_run = plain_greedy(target, input_ids, max_new_tokens=20, eos_token_id=None)
    eos = free_run[0, input_ids.shape[1] + 6].item()
    drafter = oracle_for(target, input_ids, block_size, 20)
    expected = plain_greedy(target, input_ids, max_new_tokens=20, eos_token_id=eos)
    actual = dflash(target, input_ids, drafter, do_sample=False, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(actual, expected)
    assert actual[0, -1].item() == eos and len(actual[0]) < len(free_run[0])


def test_custom_stopping_criterion_and_streamer():
    target = make_target("llama")
    input_ids = prompt(3)
    free_run = plain_greedy(target, input_ids, max_new_tokens=24, eos_token_id=None)
    stop_token = free_run[0, input_ids.shape[1] + 9].item()
    criteria = StoppingCriteriaList([StopAfterToken(stop_token, input_ids.shape[1])])
    drafter = oracle_for(target, input_ids, 4, 24)
    kwargs = dict(max_new_tokens=24, eos_token_id=None, stopping_criteria=criteria)
    expected = plain_greedy(target, input_ids, **kwargs)
    streamer = Collect()
    actual = dflash(target, input_ids, drafter, do_sample=False, dflash_streamer=streamer, **kwargs)
    assert torch.equal(actual, expected) and len(actual[0]) < len(free_run[0])
    assert [token for chunk in streamer.chunks for token in chunk] == actual[0, input_ids.shape[1] :].tolist()
    assert streamer.ended and max(len(chunk) for chunk in streamer.chunks) > 1  # accepted blocks arrive at once


def test_return_dict_scores_and_logits_match_plain():
    target = make_target("qwen2")
    input_ids = prompt(5)
    drafter = oracle_for(target, input_ids, 4, 15)
    kwargs = dict(max_new_tokens=15, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = plain_greedy(target, input_ids, repetition_penalty=1.3, **kwargs)
    actual = dflash(target, input_ids, drafter, do_sample=False, repetition_penalty=1.3, **kwargs)
    assert type(actual) is type(expected) and torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == len(actual.logits) == 15
    for name in ("scores", "logits"):
        for mine, theirs in zip(getattr(actual, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    cache = actual.cache if "cache" in type(actual).__dataclass_fields__ else actual.past_key_values
    assert cache.get_seq_length() == actual.sequences.shape[1] - 1  # no rejected draft left behind


def test_greedy_with_logits_processors_matches_plain():
    target = make_target("mistral_gqa")
    drafter = make_drafter(target, block_size=5)
    input_ids = prompt(6)
    kwargs = dict(max_new_tokens=30, repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=10)
    assert torch.equal(
        dflash(target, input_ids, drafter, do_sample=False, **kwargs), plain_greedy(target, input_ids, **kwargs)
    )


@torch.no_grad()
def test_sampling_preserves_target_distribution():
    """The 2nd new token (drafted, then verified by rejection sampling) follows its exact marginal under the
    target with the same warpers, and drafts really were accepted. (600 draws: the package's loop is checked
    with 1,200 in test_generation_sampling.py, and both use the same `speculative_sample`.)"""
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    counter = CountForwards(target)
    draws, accepted = 600, 0
    for _ in range(draws):
        before = counter.calls
        out = dflash(target, prefix, drafter, do_sample=True, max_new_tokens=3, eos_token_id=None, **warpers)
        counts[out[0, prefix.shape[1] + 1]] += 1
        accepted += counter.calls - before < 3  # 3 tokens in fewer than 3 forwards: a draft was kept
    assert chi_square_against(counts, p_second, "custom_generate(do_sample)").pvalue > ALPHA
    assert accepted > 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=2), "greedy decoding and sampling"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(num_return_sequences=2, do_sample=True), "one sequence at a time"),
        (dict(use_cache=False), "cache"),
    ],
)
def test_refuses_what_it_does_not_serve(options, message):
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=message):
        dflash(target, prompt(7), drafter, **{"max_new_tokens": 5, **options})


def test_refuses_several_prompts():
    target = make_target("llama")
    with pytest.raises(ValueError, match="one sequence at a time"):
        dflash(target, torch.cat([prompt(7), prompt(8)]), make_drafter(target), max_new_tokens=5)


def test_refuses_a_drafter_for_another_target():
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.config.num_target_layers = 12
    with pytest.raises(ValueError, match="num_target_layers is 12, the target's 6"):
        dflash(target, prompt(7), drafter, max_new_tokens=5)


def test_saved_folder_generates_with_custom_generate(tmp_path):
    """save_hub (and so export) writes custom_generate/generate.py, the package's file verbatim, and
    `generate(custom_generate=<folder>, trust_remote_code=True)` loads the folder's drafter and runs it."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    folder = save_hub(drafter, tmp_path / "drafter")
    assert (folder / CUSTOM_GENERATE_FILE).read_text() == CUSTOM_GENERATE_SOURCE.read_text()
    input_ids = prompt(9)
    expected = plain_greedy(target, input_ids, max_new_tokens=25)
    actual = target.generate(
        input_ids, do_sample=False, max_new_tokens=25, custom_generate=str(folder), trust_remote_code=True
    )
    assert torch.equal(actual, expected)
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(input_ids, max_new_tokens=5, custom_generate=str(folder))


@pytest.mark.parametrize(
    "code, standalone, message",
    [
        ("import torch\nfrom hf_dflash import load_drafter\n", False, "imports hf_dflash"),
        ("import hf_dflash.generation\n", True, "imports hf_dflash"),
        ("from .modeling_dflash import DFlashDraftModel\n", True, "relative import"),
    ],
)
def test_remote_code_importing_our_package_is_refused(tmp_path, monkeypatch, code, standalone, message):
    code_file = tmp_path / "code.py"
    code_file.write_text(code)
    with pytest.raises(RuntimeError, match=message):
        check_remote_code(code_file, standalone=standalone)
    if standalone:  # save_hub runs the check on the custom_generate file it writes
        monkeypatch.setattr(hub_module, "CUSTOM_GENERATE_SOURCE", code_file)
        with pytest.raises(RuntimeError, match=message):
            save_hub(make_drafter(make_target("llama")), tmp_path / "out")
    check_remote_code(CUSTOM_GENERATE_SOURCE, standalone=True)  # the real file passes
