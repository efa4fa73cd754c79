"""Train/serve consistency: the serving-walk estimate from the packed training forward equals, round
for round, the τ that `generate` serves on the same chat (greedy, fp32, data = the target's own reply)."""

import pytest
import torch

from hf_dflash.trainer.consistency import anchor_taus, reply_spans, served_tau_estimate, walk_served_rounds
from tests.conftest import OracleDrafter, make_drafter, make_target


def test_reply_spans_and_the_walk():
    assert reply_spans([0, 0, 1, 1, 1, 0, 1, 1]) == [(2, 5), (6, 8)]
    tau_at = {2: 2, 3: 1, 4: 1, 6: 1}
    assert walk_served_rounds(tau_at, [(2, 5), (6, 8)]) == [2, 1]  # 2 -> 4 (last token: no round); 6 -> 7
    assert walk_served_rounds({2: 4, 3: 1}, [(2, 5)]) == [2]  # never past the reply's last token
    correct = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)  # 3 blocks of 4
    assert anchor_taus(correct, 4).tolist() == [3, 4, 1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [4, 6])
def test_served_walk_equals_generate_round_for_round(arch, block_size):
    target = make_target(arch)
    prompt = torch.tensor([[5, 17, 33, 9, 71, 12]])
    length = 40
    plain = target.generate(prompt, do_sample=False, max_new_tokens=length, eos_token_id=None)
    # A drafter right most of the time: it knows the greedy continuation, except at a few positions.
    believed = plain.clone()
    for position in (9, 10, 17, 25, 26, 27, 33, 41):
        believed[0, position] = (believed[0, position] + 1) % 128
    config = make_drafter(target, block_size=block_size).config
    drafter = OracleDrafter(config, target.lm_head.weight, believed).eval()
    served = target.generate(prompt, do_sample=False, max_new_tokens=length, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(served, plain)
    served_rounds = drafter.last_acceptance.acceptance_lengths
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * length}
    estimate = served_tau_estimate(drafter, target, [sample], anchors_per_forward=7)
    assert estimate.rounds == served_rounds
    assert 1 < estimate.served_tau and estimate.uniform_tau != estimate.served_tau


def oracle_on_a_40_token_reply(**drafter_sizes):
    """(target, prompt, its 40-token greedy reply, an oracle drafter of block 4 wrong at 5 positions)."""
    target = make_target("llama")
    prompt = torch.tensor([[5, 17, 33, 9, 71, 12]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None)
    believed = plain.clone()
    for position in (9, 10, 17, 25, 33):
        believed[0, position] = (believed[0, position] + 1) % 128
    config = make_drafter(target, block_size=4, **drafter_sizes).config
    return target, prompt, plain, OracleDrafter(config, target.lm_head.weight, believed).eval()


@pytest.mark.parametrize("served_tokens", [2, 13, 20])
def test_a_reply_cut_to_n_tokens_walks_as_generate_with_max_new_tokens_n(served_tokens):
    """max_reply_tokens = N: the estimate's rounds on a 40-token reply equal generate(max_new_tokens=N)'s."""
    target, prompt, plain, drafter = oracle_on_a_40_token_reply()
    target.generate(prompt, do_sample=False, max_new_tokens=served_tokens, eos_token_id=None, assistant_model=drafter)
    served_rounds = drafter.last_acceptance.acceptance_lengths
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * 40}
    estimate = served_tau_estimate(drafter, target, [sample], anchors_per_forward=7, max_reply_tokens=served_tokens)
    assert estimate.rounds == served_rounds and sum(estimate.rounds) == served_tokens - 1
    whole = served_tau_estimate(drafter, target, [sample], anchors_per_forward=7)
    assert whole.rounds[: len(served_rounds) - 1] == served_rounds[:-1]  # the same walk, cut short
    with pytest.raises(ValueError, match="max_reply_tokens=1"):
        served_tau_estimate(drafter, target, [sample], max_reply_tokens=1)


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_a_dflash2_estimate_walks_the_selector_as_generate_does(scale):
    """An oracle drafter with a DFlash2 selector (identity, or re-ranking its top-4): estimated rounds ==
    served rounds; the re-ranking selector accepts less than the identity one."""
    target = make_target("llama")
    prompt = torch.tensor([[5, 17, 33, 9, 71, 12]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None)
    dflash2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4)
    config = make_drafter(target, block_size=4, **dflash2).config
    drafter = OracleDrafter(config, target.lm_head.weight, plain).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in drafter.candidate_selector.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        drafter.candidate_selector.hidden_projection.weight.mul_(scale)
    served = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(served, plain)
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * 40}
    estimate = served_tau_estimate(drafter, target, [sample], anchors_per_forward=7)
    assert estimate.rounds == drafter.last_acceptance.acceptance_lengths
    assert (min(estimate.rounds[:-1]) == 4) == (scale == 0)  # identity: every draft right; re-ranked: some wrong


def test_random_drafter_estimates_tau_one():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    sample = {"input_ids": list(range(3, 40)), "loss_mask": [0] * 5 + [1] * 32}
    estimate = served_tau_estimate(drafter, target, [sample])
    assert 1 <= estimate.served_tau < 1.5 and len(estimate.per_sample) == 1


def test_tree_estimate_of_a_top1_tree_is_the_chain_estimate_and_grows_with_the_budget():
    """A tree of the top-1 token per slot and block_size nodes IS the chain; bigger trees never accept less."""
    from hf_dflash.trainer.consistency import served_tree_tau_estimates

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    samples = [
        {"input_ids": list(range(3, 45)), "loss_mask": [0] * 6 + [1] * 36},
        {"input_ids": [7, 9] * 15, "loss_mask": [0] * 4 + [1] * 26},
    ]
    chain = served_tau_estimate(drafter, target, samples, anchors_per_forward=9)
    top1 = served_tree_tau_estimates(drafter, target, samples, budgets=[4], top_k=1)[4]
    assert top1.rounds == chain.rounds and top1.uniform_tau == chain.uniform_tau
    trees = served_tree_tau_estimates(drafter, target, samples, budgets=[1, 4, 16, 64], top_k=8)
    assert trees[1].served_tau == 1.0  # the root alone drafts nothing
    uniform = [trees[n].uniform_tau for n in (1, 4, 16, 64)]
    assert uniform == sorted(uniform) and uniform[-1] > uniform[0]


@pytest.mark.parametrize("dflash2", [False, True])
def test_tree_estimates_equal_generate_with_trees_round_for_round(dflash2):
    """An oracle drafter (DFlash, or DFlash2 whose selector re-ranks) serving trees of 6 nodes: the estimate's
    rounds for budget 6 are generate's."""
    from hf_dflash.trainer.consistency import served_tree_tau_estimates

    sizes = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4) if dflash2 else {}
    target, prompt, plain, drafter = oracle_on_a_40_token_reply(**sizes)
    if dflash2:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in drafter.candidate_selector.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    drafter.draft_tree = 6
    served = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(served, plain)
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * 40}
    estimate = served_tree_tau_estimates(drafter, target, [sample], budgets=[6], top_k=4, anchors_per_forward=7)[6]
    served_rounds = drafter.last_acceptance.acceptance_lengths
    # the last round has room for fewer slots than the block: generate's tree of 6 then spends its nodes on
    # fewer depths, the estimate's (full block) does not; every earlier round is the same tree
    last = len(served_rounds) - 1
    assert estimate.rounds[:last] == served_rounds[:last] and max(served_rounds) > 1


def test_served_tau_by_source_weighs_each_sample_by_its_rounds():
    from hf_dflash.trainer.consistency import ServedTauEstimate
    from hf_dflash.trainer.heldout import served_tau_by_source

    samples = [{"id": "gsm8k:1"}, {"id": "gsm8k:7"}, {"id": "sharegpt:3"}]
    estimate = ServedTauEstimate(2.0, 2.0, [], per_sample=[3.0, 1.5, 2.0], per_sample_rounds=[2, 4, 5])
    assert served_tau_by_source(samples, estimate) == {
        "gsm8k": {"served_tau": 2.0, "samples": 2, "rounds": 6},  # (3 x 2 + 1.5 x 4) / 6
        "sharegpt": {"served_tau": 2.0, "samples": 1, "rounds": 5},
    }
