"""The budget of hybrid drafting: the cost of a tree round, the (k, m) argmax, the per-branch estimates,
and the verification times in the cost-model cache."""

import json

import pytest
import torch

from hf_dflash.generation.policies.block_size import AdaptiveBlockSize, FixedBlockSize
from hf_dflash.generation.policies.cost_model import CostModel, measured_verification_lengths
from hf_dflash.generation.policies.cost_timing import (
    cost_model_key,
    cost_model_path,
    measure_drafting_seconds,
    measure_verification_seconds,
    measured_cost_model,
)
from hf_dflash.generation.policies.hybrid_budget import TreeBudget, best_split
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import FakeMeasure


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_tree_round_seconds_add_the_extra_verified_tokens_to_the_round():
    model = CostModel((1, 2, 3), {1: (1.0, 2.0, 2.5)}, (1, 2, 4), {1: (1.0, 1.5, 3.5)})
    # verify(n) = 1, 1.5, 2.5, 3.5, 4.5 for n = 1..5 (linear past 4); round(k) = 1, 2, 2.5
    expected = tensor([[1.0, 1.5, 2.5], [2.0, 3.0, 4.0], [2.5, 3.5, 4.5]])  # round(k) + verify(k+m) - verify(k)
    torch.testing.assert_close(model.tree_round_seconds(1, 3, 2), expected)
    torch.testing.assert_close(model.verification_seconds_per_length(2, 2), tensor([2.0, 3.0]))  # 2 rows: proportional
    without = CostModel((1, 2, 3), {1: (1.0, 2.0, 2.5)})  # no verification times: the round times stand in
    torch.testing.assert_close(without.tree_round_seconds(1, 2, 1), tensor([[1.0, 2.0], [2.0, 2.5]]))
    assert measured_verification_lengths(16) == (1, 2, 4, 8, 12, 16, 20, 24, 32)
    assert measured_verification_lengths(5) == (1, 2, 4, 5, 8, 10)


@pytest.mark.parametrize(
    "lengths, seconds, match",
    [
        ((2,), {1: (1.0,)}, "verification_lengths must increase from 1"),
        ((1, 2), {1: (1.0,)}, "2 positive seconds"),
        ((1,), {}, "verification_seconds is empty"),
    ],
)
def test_cost_model_rejects_malformed_verification_tables(lengths, seconds, match):
    with pytest.raises(ValueError, match=match):
        CostModel((1,), {1: (1.0,)}, lengths, seconds)


def test_best_split_by_hand():
    expected_block = tensor([1.0, 1.5, 1.75])  # E_block(k), k = 1..3
    gain = tensor([0.0, 0.9, 1.5])  # G(m), m = 0..2
    seconds = torch.ones(3, 3)
    assert best_split(expected_block, gain, seconds, one_branch=False) == (3, 2)  # 3.25 tokens
    assert best_split(expected_block, gain, seconds, one_branch=True) == (1, 2)  # 2.5 beats 1.75
    seconds = tensor([[1.0, 1.0, 2.0], [1.2, 1.4, 2.4], [1.4, 2.0, 3.0]])
    assert best_split(expected_block, gain, seconds, one_branch=False) == (1, 1)  # 1.9 tokens/s
    flat = torch.ones(3, 1)
    assert best_split(tensor([1.0, 1.0, 1.0]), tensor([0.0]), flat, one_branch=False) == (1, 0)  # ties: smallest


def test_tree_budget_learns_each_branch_and_skips_what_is_never_accepted():
    cost = CostModel.from_function(lambda k: 1.0 + 0.5 * (k > 1), 4, lambda n: 1.0 + 0.2 * (n - 1), 8)
    budget = TreeBudget(4, 3, one_branch=False, settings=AdaptiveBlockSize(), cost_model=cost)
    assert budget.choose(3) == (4, 3)  # optimistic prior: everything
    assert budget.choose(3, block_allowed=False) == (1, 3)  # the prefill: no block
    for _ in range(10):  # beside the n-gram drafts the block is always rejected; they are always accepted
        budget.choose(3)
        budget.observe(block_compared=1, block_agreed=0, ngram_compared=3, ngram_agreed=3)
    assert budget.choose(3) == (1, 3)
    assert budget.choose(1) == (1, 1)  # only one n-gram draft found this round
    assert budget.choose(0) == (4, 0)  # without n-gram drafts, the block still has its (untouched) prior
    for _ in range(20):  # now the n-gram branch is always wrong too (rounds without a match leave it alone)
        budget.choose(3)
        budget.observe(1, 0, 1, 0)
        budget.choose(0)
        budget.observe(1, 0, 0, 0)
    assert budget.choose(3) == (1, 0) and budget.choose(0) == (1, 0)


def test_estimates_are_kept_per_match_length():
    """A 4-token match that always copies right and a 1-token match that never does: the budget offers the
    n-gram drafts of the first, and the block where there is only the second."""
    cost = CostModel.from_function(lambda k: 1.0 + 0.5 * (k > 1), 4, lambda n: 1.0 + 0.2 * (n - 1), 8)
    budget = TreeBudget(4, 3, one_branch=False, settings=AdaptiveBlockSize(), cost_model=cost)
    for _ in range(10):
        budget.choose(3, match_length=5)
        budget.observe(block_compared=1, block_agreed=0, ngram_compared=3, ngram_agreed=3)
        budget.choose(3, match_length=1)
        budget.observe(block_compared=3, block_agreed=3, ngram_compared=1, ngram_agreed=0)
    assert budget.choose(3, match_length=4) == (1, 3)
    assert budget.choose(3, match_length=1) == (4, 0)


def test_block_beside_ngram_counts_only_what_beats_the_ngram_branch():
    budget = TreeBudget(4, 3, one_branch=False, settings=AdaptiveBlockSize(decay=1.0), block=FixedBlockSize(4))
    budget.choose(3)
    budget.observe(block_compared=3, block_agreed=2, ngram_compared=3, ngram_agreed=3)  # n-gram got further
    budget.choose(3)
    budget.observe(block_compared=3, block_agreed=3, ngram_compared=3, ngram_agreed=1)  # the block won
    assert budget.block_beside_ngram[0].successes.tolist() == [[1.0, 1.0, 1.0]]  # bucket 0: 1-token matches
    assert budget.block_beside_ngram[0].trials.tolist() == [[2.0, 1.0, 1.0]]
    assert budget.block_estimate.trials.sum() == 0  # rounds with n-gram drafts leave the plain estimate alone
    one = TreeBudget(4, 3, one_branch=True, settings=AdaptiveBlockSize(decay=1.0), block=FixedBlockSize(4))
    one.choose(3)
    one.observe(3, 2, 3, 3)  # one branch verified: the block counts for all it got accepted
    assert one.block_estimate.successes.tolist() == [[1.0, 1.0, 0.0]]


def test_tree_budget_with_a_fixed_block_size():
    budget = TreeBudget(4, 3, one_branch=False, settings=AdaptiveBlockSize(), block=FixedBlockSize(3))
    assert budget.choose(2) == (3, 2) and budget.choose(0) == (3, 0)  # a full tree
    one = TreeBudget(4, 3, one_branch=True, settings=AdaptiveBlockSize(), block=FixedBlockSize(3))
    assert one.choose(3) == (1, 3)  # prior: 4 expected tokens from 3 n-gram drafts beat 3 from the block
    for _ in range(10):
        one.observe(0, 0, 3, 0)
    assert one.choose(3) == (3, 0)
    with pytest.raises(ValueError, match="exactly one"):
        TreeBudget(4, 3, False, AdaptiveBlockSize())


class FakeVerification:
    def __init__(self):
        self.calls = []

    def __call__(self, target, drafter, rows, lengths):
        self.calls.append(rows)
        return [rows * (1.0 + 0.01 * n) for n in lengths]


class FakeDrafting(FakeMeasure):
    def __call__(self, target, drafter, rows, block_lengths):
        self.calls.append(rows)
        return [0.0 if k == 1 else 0.01 * rows * k for k in block_lengths]


def test_verification_and_drafting_times_are_cached_beside_the_round_times(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    measure, verification, drafting = FakeMeasure(), FakeVerification(), FakeDrafting()
    plain = measured_cost_model(target, drafter, (1,), tmp_path, measure)
    assert not plain.has_verification and not plain.drafting_seconds
    model = measured_cost_model(target, drafter, (1,), tmp_path, measure, True, verification, measure_drafting=drafting)
    assert measure.calls == [1] and verification.calls == [1] and drafting.calls == [1]  # rounds were cached
    assert model.verification_lengths == (1, 2, 4, 8) and model.seconds == plain.seconds
    assert model.drafting_seconds == {1: (0.0, 0.02, 0.04)}  # block lengths 1, 2, 4
    data = json.loads(cost_model_path(cost_model_key(target, drafter), tmp_path).read_text())
    assert data["verification_lengths"] == [1, 2, 4, 8] and data["drafting_seconds"] == {"1": [0.0, 0.02, 0.04]}
    again = measured_cost_model(target, drafter, (1,), tmp_path, measure, True, verification, measure_drafting=drafting)
    assert again == model and verification.calls == [1] and drafting.calls == [1]
    assert measured_cost_model(target, drafter, (1,), tmp_path, measure) == model  # a plain call reads it too


def test_a_cache_without_drafting_times_gets_them_and_keeps_the_rest(tmp_path):
    """Cost models cached before the drafter's pass was timed alone: only that is measured."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    measure, verification, drafting = FakeMeasure(), FakeVerification(), FakeDrafting()
    measured_cost_model(target, drafter, (1,), tmp_path, measure, True, verification, measure_drafting=drafting)
    path = cost_model_path(cost_model_key(target, drafter), tmp_path)
    data = json.loads(path.read_text())
    del data["drafting_seconds"]
    path.write_text(json.dumps(data))
    model = measured_cost_model(target, drafter, (1,), tmp_path, measure, True, verification, measure_drafting=drafting)
    assert measure.calls == [1] and verification.calls == [1] and drafting.calls == [1, 1]
    assert model.drafting_seconds == {1: (0.0, 0.02, 0.04)}


def test_drafting_times_join_a_cache_whose_verification_covers_more_tokens(tmp_path):
    """Verification timed over a draft tree's 16 tokens serves a hybrid call asking for 8; timing the drafter's
    pass for that file keeps the 16 (it once rebuilt the model with the 8 asked for, and refused it)."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    measure, verification, drafting = FakeMeasure(), FakeVerification(), FakeDrafting()
    kwargs = dict(measure=measure, verification=True, measure_verification=verification)
    measured_cost_model(target, drafter, (1,), tmp_path, **kwargs, max_verified_tokens=16, measure_drafting=drafting)
    path = cost_model_path(cost_model_key(target, drafter), tmp_path)
    data = json.loads(path.read_text())
    del data["drafting_seconds"]
    path.write_text(json.dumps(data))
    model = measured_cost_model(target, drafter, (1,), tmp_path, **kwargs, measure_drafting=drafting)
    assert model.verification_lengths == (1, 2, 4, 8, 12, 16) and drafting.calls == [1, 1]
    assert verification.calls == [1]


def test_real_drafting_measurement_times_the_drafter_alone_and_leaves_rng_alone():
    target = make_target("qwen2")
    drafter = make_drafter(target, block_size=4)
    state = torch.get_rng_state()
    seconds = measure_drafting_seconds(target, drafter, rows=1, block_lengths=(1, 2, 4), repeats=1)
    assert seconds[0] == 0.0 and all(s > 0 for s in seconds[1:]) and list(seconds) == sorted(seconds)
    assert torch.equal(torch.get_rng_state(), state)


def test_cost_model_rejects_a_malformed_drafting_table():
    with pytest.raises(ValueError, match="drafting_seconds"):
        CostModel((1, 2), {1: (1.0, 2.0)}, drafting_seconds={1: (0.0,)})
    with pytest.raises(ValueError, match="drafting_seconds"):
        CostModel((1, 2), {1: (1.0, 2.0)}, drafting_seconds={2: (0.0, 0.1)})  # rows not timed in seconds


def test_real_verification_measurement_is_positive_and_leaves_rng_alone():
    target = make_target("qwen2")
    drafter = make_drafter(target, block_size=4)
    state = torch.get_rng_state()
    seconds = measure_verification_seconds(target, drafter, rows=1, lengths=(1, 3, 8), repeats=1)
    assert len(seconds) == 3 and all(s > 0 for s in seconds) and list(seconds) == sorted(seconds)
    assert torch.equal(torch.get_rng_state(), state)


def test_unreached_copy_slots_accept_like_the_slot_before_them():
    """A rejected first n-gram draft lowers what every deeper copy slot is expected to add (each shrinks toward
    the slot before it, as a model's slots do), so a run of poor matches stops predicting long copies."""
    from hf_dflash.generation.policies.hybrid_budget import TreeBudget

    budget = TreeBudget(4, 3, one_branch=False, settings=AdaptiveBlockSize(decay=1.0), block=[2])
    copy = budget.ngram_estimates[0]
    torch.testing.assert_close(copy.expected_tokens(), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    copy.observe(compared=1, agreed=0)  # the first draft was rejected once
    torch.testing.assert_close(copy.expected_tokens(), torch.tensor([1.0, 1.5, 1.75, 1.875], dtype=torch.float64))
    for _ in range(3):
        copy.observe(compared=3, agreed=3)  # then three copies right to the end
    torch.testing.assert_close(copy.expected_tokens()[1], torch.tensor(1.8, dtype=torch.float64))


def test_fixed_verification_cost_keeps_drafting_and_flattens_verification():
    """Compiled rounds of drafts verify one width: round(k) = drafting(k) + verify(width), verify(n) = verify(width)
    for n >= 2; a plain step (k = 1, one token) runs its own width-1 graph and keeps its cost."""
    cost = CostModel.from_function(lambda k: 0.1 * k + (0.01 if k > 1 else 0), 8, verification=lambda n: 0.1 * n)
    fixed = cost.at_fixed_verification(8)
    rounds = fixed.round_seconds(1, 8)
    assert torch.allclose(rounds, torch.tensor([0.1] + [0.81] * 7, dtype=torch.float64))
    verify = fixed.verification_seconds_per_length(1, 16)
    assert torch.allclose(verify, torch.tensor([0.1] + [0.8] * 15, dtype=torch.float64))
    # a hybrid round: a plain step alone keeps its cost, any round with drafts verifies the fixed width
    trees = fixed.tree_round_seconds(1, 8, 4)
    assert torch.isclose(trees[0, 0], torch.tensor(0.1, dtype=torch.float64))
    assert torch.allclose(trees[0, 1:], torch.full((4,), 0.8, dtype=torch.float64))
    assert torch.allclose(trees[1:], torch.full((7, 5), 0.81, dtype=torch.float64))
    with pytest.raises(ValueError, match="verification=True"):
        CostModel.from_function(lambda k: 0.1 * k, 8).at_fixed_verification(8)
    # a hybrid budget under compiled verification follows the width of a one-size tree once it is chosen
    budget = TreeBudget(8, 4, False, AdaptiveBlockSize(), cost_model=cost.at_fixed_verification(20), measured=cost)
    budget.verify_at(12)
    assert torch.allclose(budget.seconds, cost.at_fixed_verification(12).tree_round_seconds(1, 8, 4))
    with pytest.raises(ValueError, match="measured"):
        TreeBudget(8, 4, False, AdaptiveBlockSize(), cost_model=cost).verify_at(12)


def test_fixed_verification_prices_drafting_by_the_drafter_pass_timed_alone():
    """Read off as round(k) - verify(k), two timings taken apart, drafting came out at 0 in fp32 (a tree-masked
    verification timed slower than the round's whole): with the drafter's pass timed alone, that is its price."""
    lengths = (1, 2, 4, 8)
    rounds = {1: (0.050, 0.064, 0.080, 0.090)}
    verify = (1, 2, 4, 8, 16), {1: (0.057, 0.064, 0.083, 0.104, 0.110)}
    differenced = CostModel(lengths, rounds, *verify).at_fixed_verification(16)
    assert torch.allclose(differenced.round_seconds(1, 8)[[1, 3, 7]], torch.tensor([0.110] * 3, dtype=torch.float64))
    timed = CostModel(lengths, rounds, *verify, drafting_seconds={1: (0.0, 0.006, 0.008, 0.010)})
    fixed = timed.at_fixed_verification(16).round_seconds(1, 8)
    assert torch.allclose(fixed[[0, 1, 3, 7]], torch.tensor([0.050, 0.116, 0.118, 0.120], dtype=torch.float64))
    assert CostModel.from_dict(timed.to_dict()) == timed
