"""Draft trees from the drafter's own distribution (`drafter.draft_tree`): greedy output == plain greedy token
for token (fp32) on 4 architectures, with random and always-right drafters, stops inside a path and logits
processors; sampling keeps the target distribution (chi-square); the served rounds equal the offline estimate;
the size follows the cost curve; batches and targets that cannot verify a tree draft chains."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_dflash.generation.policies.tree_size import TreeDrafting, best_tree_size, tree_drafting
from hf_dflash.trainer.consistency import served_tree_tau_estimates
from tests.conftest import ARCHITECTURES, make_drafter, make_target
from tests.helpers.generation import check_sampled_second_token, oracle_for, plain_greedy, prompt

GREEDY = dict(do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("nodes", [3, 16])
def test_random_drafter_tree_matches_plain_greedy(arch, block_size, nodes):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=block_size)
    drafter.draft_tree = nodes
    for seed in range(2):
        input_ids = prompt(seed, length=5 + seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=33, eos_token_id=None)
        assert torch.equal(target.generate(input_ids, max_new_tokens=33, assistant_model=drafter, **GREEDY), expected)
        stats = drafter.last_acceptance
        assert sum(stats.acceptance_lengths) + 1 == 33
        assert len(stats.tree_sizes) == len(stats.acceptance_lengths) and max(stats.tree_sizes) <= nodes


@pytest.mark.parametrize("max_new_tokens", [1, 2, 13, 30])
def test_oracle_drafter_tree_accepts_whole_blocks_and_never_overshoots(max_new_tokens):
    target = make_target("qwen3")
    input_ids = prompt(1)
    drafter = oracle_for(target, input_ids, block_size=5, max_new_tokens=max_new_tokens)
    drafter.draft_tree = 12
    expected = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    actual = target.generate(input_ids, max_new_tokens=max_new_tokens, assistant_model=drafter, **GREEDY)
    assert torch.equal(actual, expected)
    lengths = drafter.last_acceptance.acceptance_lengths
    assert sum(lengths) + 1 == max_new_tokens and all(tau == 5 for tau in lengths[:-1])


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int, start: int):
        self.token, self.start = token, start

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.start :] == self.token).any(-1)


def test_stops_inside_an_accepted_path_and_logits_processors_match_plain():
    target = make_target("llama")
    input_ids = prompt(3)
    drafter = oracle_for(target, input_ids, block_size=6, max_new_tokens=40)
    drafter.draft_tree = 10
    free = plain_greedy(target, input_ids, max_new_tokens=30, eos_token_id=None)
    stop = int(free[0, input_ids.shape[1] + 8])  # a token met inside a round
    criteria = StoppingCriteriaList([StopAfterToken(stop, input_ids.shape[1])])
    kwargs = dict(max_new_tokens=30, stopping_criteria=criteria, **GREEDY)
    assert torch.equal(
        target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
    )
    random = make_drafter(target, block_size=6)
    random.draft_tree = 16
    kwargs = dict(max_new_tokens=30, repetition_penalty=1.3, no_repeat_ngram_size=3, **GREEDY)
    assert torch.equal(
        target.generate(input_ids, assistant_model=random, **kwargs), target.generate(input_ids, **kwargs)
    )


def test_sampling_through_a_tree_keeps_the_target_distribution():
    """Chi-square on the 2nd new token (drafted in a tree, verified by sampling the target at each node)."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.draft_tree = 12
    check_sampled_second_token(target, drafter, "tree, 12 nodes")


def test_served_tree_rounds_equal_the_offline_estimate():
    """Train/serve consistency for trees: the rounds `generate` serves with a fixed tree size are the rounds
    the packed training forward predicts (fp32, data = the target's own greedy reply)."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4, seed=3)
    drafter.draft_tree = 8
    input_ids = torch.tensor([[5, 17, 33, 9, 71, 12]])
    plain = plain_greedy(target, input_ids, max_new_tokens=40, eos_token_id=None)
    served = target.generate(input_ids, max_new_tokens=40, assistant_model=drafter, **GREEDY)
    assert torch.equal(served, plain)
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * input_ids.shape[1] + [1] * 40}
    estimate = served_tree_tau_estimates(drafter, target, [sample], budgets=[8], top_k=16)[8]
    assert estimate.rounds == drafter.last_acceptance.acceptance_lengths
    assert max(estimate.rounds) > 1  # the tree accepted drafts: the check is not vacuous


def test_best_tree_size_weighs_probability_against_cost():
    reach = torch.tensor([0.0, -0.1, -0.5, -2.0, -4.0]).double()  # nodes in decreasing probability
    flat = torch.ones(5, dtype=torch.float64)
    assert best_tree_size(reach, flat) == 5  # free nodes: take them all
    steep = torch.tensor([1.0, 1.2, 1.6, 2.4, 3.2], dtype=torch.float64)
    p = reach.exp()
    rates = [(1 + sum(p[1:n])) / steep[n - 1] for n in range(1, 6)]
    assert best_tree_size(reach, steep) == int(torch.tensor(rates).argmax()) + 1
    assert best_tree_size(reach, steep, calibration=0.0) == 1  # a drafter never right: no drafts


def test_auto_tree_size_follows_the_cost_curve_and_calibration():
    trees = TreeDrafting(8, top_k=4, seconds=torch.tensor([1.0, 1.1, 1.2, 3.0, 3.0, 3.0, 3.0, 3.0]))
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0], [5.0, 4.9, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    tree = trees.build(7, logits, torch.tensor([10, 11, 12, 13]))
    assert tree.num_nodes == 3  # the 4th node would triple the cost
    for _ in range(20):
        trees.observe(0)  # never accepted: the calibration falls, and with it the tree
    assert trees.calibration < 0.2 and trees.build(7, logits, None).num_nodes == 1


def test_best_tree_size_never_below_min_nodes():
    reach = torch.tensor([0.0, -0.1, -5.0, -6.0, -7.0]).double()
    steep = torch.tensor([1.0, 1.1, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert best_tree_size(reach, steep) == 2
    assert best_tree_size(reach, steep, min_nodes=4) == 4  # the best rate among n >= 4
    assert best_tree_size(reach, steep, min_nodes=9) == 5  # never more than the tree holds


def test_one_size_trees_fix_their_size_at_the_first_tree():
    """Compiled verification reads one width per call: "auto" chooses it once, at the first tree, as the
    n >= min_nodes with the best expected rate; every later tree has that many nodes whatever the cost."""
    seconds = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0])
    trees = TreeDrafting(8, top_k=4, seconds=seconds, min_nodes=3, one_size=True)
    assert trees.choosing_size
    sure = torch.tensor([[9.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0], [9.0, 0.0, 0.0, 0.0]])
    assert trees.build(7, sure, None).num_nodes == 5  # free up to 5 nodes, 5x dearer beyond
    assert not trees.choosing_size and trees.max_nodes == 5 and trees.seconds is None
    for _ in range(5):
        trees.observe(0)  # a calibration that would shrink an "auto" tree
    assert trees.build(7, torch.zeros(3, 4), None).num_nodes == 5
    unsure = TreeDrafting(8, top_k=4, seconds=torch.arange(1.0, 9.0), min_nodes=3, one_size=True)
    assert unsure.build(7, torch.zeros(3, 4), None).num_nodes == 3  # dear nodes: min_nodes, not fewer
    with pytest.raises(ValueError, match="one_size"):
        TreeDrafting(8, one_size=True)  # no cost curve to choose the size from


def test_settings_batches_and_targets_that_cannot_verify_a_tree():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    for bad in (1, "big", 2.5, True):
        drafter.draft_tree = bad
        with pytest.raises(ValueError, match="draft_tree"):
            tree_drafting(drafter, target)
    drafter.draft_tree = 8
    batch = torch.tensor([[0, 0, 5, 17, 33], [9, 71, 12, 4, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = target.generate(batch, attention_mask=mask, max_new_tokens=12, pad_token_id=0, **GREEDY)
    with pytest.warns(UserWarning, match="batch size 1"):
        actual = target.generate(
            batch, attention_mask=mask, max_new_tokens=12, pad_token_id=0, assistant_model=drafter, **GREEDY
        )
    assert torch.equal(actual, expected) and drafter.last_acceptance.tree_sizes == []
    from transformers import StaticCache

    input_ids = prompt(0)
    cache = StaticCache(config=target.config, max_cache_len=input_ids.shape[1] + 10)  # no room for a tree
    with pytest.warns(UserWarning, match="cannot verify a draft tree .* static cache without 8 slots"):
        out = target.generate(input_ids, max_new_tokens=10, assistant_model=drafter, past_key_values=cache, **GREEDY)
    assert torch.equal(out, plain_greedy(target, input_ids, max_new_tokens=10, eos_token_id=None))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_hybrid_with_a_drafter_tree_matches_plain_greedy(arch):
    """Hybrid drafting grafts the n-gram continuation onto the drafter's tree: one tree, one target forward."""
    from tests.helpers.hybrid import prompt as hybrid_prompt

    target = make_target(arch)
    drafter = make_drafter(target, block_size=6)
    drafter.draft_tree = 12
    drafter.block_size_policy = 6
    for seed, repeats in [(0, True), (1, False), (2, True)]:
        input_ids = hybrid_prompt(seed, repeats)
        expected = plain_greedy(target, input_ids, max_new_tokens=37, eos_token_id=None)
        actual = target.generate(
            input_ids, max_new_tokens=37, assistant_model=drafter, prompt_lookup_num_tokens=5, **GREEDY
        )
        assert torch.equal(actual, expected)
        stats = drafter.last_acceptance
        assert sum(stats.acceptance_lengths) + (not stats.first_round_in_prefill) == 37
        assert len(stats.tree_sizes) == len(stats.block_tokens) == len(stats.acceptance_lengths)
    assert max(stats.tree_sizes) > 12  # the n-gram branch was grafted onto a full drafter tree
