"""`drafter.draft_temperature`: under sampling the drafter drafts from its distribution at another temperature
(0: its argmax, a one-hot q). Any q keeps the output the target's: chi-square of the second new token through
`generate`, for DFlash and DFlash2 (its selector walks at that temperature); bad values are refused by name."""

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from hf_dflash.generation.drafting.block_drafter import BlockDrafter, at_temperature
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import check_sampled_second_token

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4)


@pytest.mark.slow
@pytest.mark.parametrize("draft_temperature", [0.0, 0.4])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_sampling_at_a_draft_temperature_keeps_the_target_distribution(kind, draft_temperature):
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4, **(DFLASH2 if kind == "dflash2" else {}))
    drafter.draft_temperature = draft_temperature
    check_sampled_second_token(target, drafter, f"{kind} draft_temperature={draft_temperature}", draws=800)


def test_argmax_drafts_are_the_greedy_drafts_with_one_hot_distributions():
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.draft_temperature = 0
    block = BlockDrafter(drafter, target)
    hidden = torch.randn(2, 3, drafter.config.hidden_size)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    prefixes = [torch.tensor([1, 2]), torch.tensor([3])]
    drafts = block.draft(hidden, True, processors, 2, [0, 1], prefixes, confidence=True)
    greedy = block.draft(hidden, False, None)
    assert torch.equal(drafts.tokens, greedy.tokens)
    assert torch.equal(drafts.scores.argmax(-1), drafts.tokens) and torch.all(drafts.scores.sum(-1) == 1)
    assert drafts.probabilities.shape == (2, 3) and torch.all((drafts.probabilities > 0) & (drafts.probabilities <= 1))


def test_the_call_temperature_is_replaced_or_added():
    top_k = TopKLogitsWarper(5)
    replaced = at_temperature(LogitsProcessorList([TemperatureLogitsWarper(0.7), top_k]), 0.3)
    assert [type(p) for p in replaced] == [TemperatureLogitsWarper, TopKLogitsWarper]
    assert replaced[0].temperature == 0.3 and replaced[1] is top_k
    added = at_temperature(LogitsProcessorList([top_k]), 0.3)
    assert [type(p) for p in added] == [TemperatureLogitsWarper, TopKLogitsWarper]


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "cold", True])
def test_a_bad_draft_temperature_is_refused_by_name(value):
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4)
    drafter.draft_temperature = value
    with pytest.raises(ValueError, match="draft_temperature"):
        target.generate(torch.tensor([[5, 17, 33]]), assistant_model=drafter, do_sample=True, max_new_tokens=4)
