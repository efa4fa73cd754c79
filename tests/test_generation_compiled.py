"""Static cache + compiled verification: the loop compiles the target's verification forward exactly where
Transformers' own decoding compiles its step, with one input shape per block length, and stays lossless
(the oracle: fp32 greedy output == plain greedy)."""

import warnings

import pytest
import torch

from hf_dflash.generation import target_slots
from hf_dflash.generation.verifying import target_forward
from tests.conftest import make_drafter, make_target
from tests.helpers.compiled import WidthSpy, compiled_dflash, cpu_compile_config
from tests.helpers.generation import plain_greedy, prompt


@pytest.mark.slow
@pytest.mark.parametrize("headroom", [4, 0])
def test_compiled_rounds_have_one_shape_and_match_plain_greedy(monkeypatch, headroom):
    """With `block_size` free slots beyond max_length (`max_cache_len`), the last rounds are padded to the
    block; without them, the rounds whose padded block would not fit run eager (no index error, no new
    shape): one compiled shape either way."""
    target = make_target("llama")
    input_ids = prompt(0, length=9)
    max_new_tokens = 23  # not a multiple of what rounds commit: the last rounds fit fewer drafts
    expected = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)  # random: rejections roll the static cache back
    paddings = []
    pad_round = target_forward.pad_round
    monkeypatch.setattr(target_forward, "pad_round", lambda tokens, n: paddings.append(n) or pad_round(tokens, n))
    spy = WidthSpy(target)
    max_length = input_ids.shape[1] + max_new_tokens
    room = {"max_cache_len": max_length + headroom} if headroom else {}  # default: max_length - 1 slots
    actual = compiled_dflash(target, drafter, input_ids, max_new_tokens, **room)
    assert torch.equal(actual, expected)
    assert spy.widths and set(spy.widths) == {4}  # every compiled round: one graph
    rounds_after_prefill = len(drafter.last_acceptance.acceptance_lengths)
    if headroom:  # the first compiled forward compiles the round's graph before the prefill (`warm_graphs`)
        assert paddings and len(spy.widths) == 1 + rounds_after_prefill  # the short last rounds were padded
    assert 1 in drafter.last_acceptance.acceptance_lengths  # some round rejected drafts


@pytest.mark.slow
@pytest.mark.parametrize("drafted_round_seconds", [100.0, 1.2])
def test_compiled_plain_steps_run_their_own_graph_and_match_plain_greedy(drafted_round_seconds):
    """Where the adaptive policy prices drafting above what it returns, it takes plain steps; compiled, a plain
    step runs its own width-1 graph (as plain decoding's), not a round padded to the block. Both graphs are
    compiled before the prefill, so no timed round compiles. 100 s a drafted round: every round is a plain step;
    1.2 s (a random drafter, acceptance low): the policy alternates. Either way the output is plain greedy's."""
    from hf_dflash.generation.policies.block_size import AdaptiveBlockSize
    from hf_dflash.generation.policies.cost_model import CostModel

    target = make_target("llama")
    input_ids = prompt(1, length=9)
    expected = plain_greedy(target, input_ids, max_new_tokens=30, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)
    cost = CostModel.from_function(
        lambda k: 1.0 if k == 1 else drafted_round_seconds, 4, verification=lambda n: 1.0 if n == 1 else 1.1
    )
    drafter.block_size_policy = AdaptiveBlockSize(cost_model=cost)
    spy = WidthSpy(target)
    actual = compiled_dflash(target, drafter, input_ids, 30, max_cache_len=input_ids.shape[1] + 30 + 4)
    assert torch.equal(actual, expected)
    assert spy.widths[:2] == [1, 4]  # the warm-up forwards, before the prefill
    blocks = drafter.last_acceptance.block_sizes
    plain_steps = sum(1 for k in blocks if k == 1)
    assert spy.widths[2:].count(1) >= plain_steps and set(spy.widths[2:]) <= {1, 4}  # (+ rounds with no room)
    if drafted_round_seconds == 100.0:
        assert set(blocks) == {1} and set(spy.widths[2:]) == {1}
    else:
        assert {1, 4} <= set(blocks)


def test_static_cache_without_compile_stays_eager_and_unpadded(monkeypatch):
    target = make_target("llama")
    input_ids = prompt(2, length=9)
    drafter = make_drafter(target, block_size=4)
    monkeypatch.setattr(target_forward, "pad_round", lambda *args: pytest.fail("an eager round was padded"))
    actual = target.generate(
        input_ids, do_sample=False, max_new_tokens=21, eos_token_id=None, assistant_model=drafter,
        cache_implementation="static",
    )  # fmt: skip
    assert torch.equal(actual, plain_greedy(target, input_ids, max_new_tokens=21, eos_token_id=None))
    assert not hasattr(target, "_compiled_call")  # no compile on CPU unless compile_config asks for it


def test_dynamic_cache_stays_eager():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    input_ids = prompt(1)
    actual = target.generate(
        input_ids, do_sample=False, max_new_tokens=12, assistant_model=drafter, compile_config=cpu_compile_config()
    )
    assert torch.equal(actual, plain_greedy(target, input_ids, max_new_tokens=12))
    assert not hasattr(target, "_compiled_call")


def test_inductor_freezing_is_refused_before_anything_compiles():
    """Freezing folds the static cache into the graph: a second call would verify against the first call's
    cache (measured on SmolLM2: τ 2.00 -> 1.29). Refused with the fix, before any compile."""
    import torch._inductor.config as inductor_config

    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    with inductor_config.patch(freezing=True), pytest.raises(ValueError, match="freezing = False"):
        compiled_dflash(target, drafter, prompt(3), 8)
    assert not hasattr(target, "_compiled_call")


def test_a_cache_that_cannot_roll_back_is_refused_with_the_fix(monkeypatch):
    """Transformers 5.23's static layers have no `crop`: rejected drafts could not be rolled back."""
    from transformers.cache_utils import StaticLayer

    monkeypatch.setattr(StaticLayer, "is_croppable", False)
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="StaticLayer layers cannot be rolled back .* from 5.24 on"):
        target.generate(prompt(4), max_new_tokens=4, assistant_model=drafter, cache_implementation="static")


@pytest.mark.slow
@pytest.mark.parametrize("draft_tree", [None, 4])
def test_compiled_sampling_preserves_target_distribution(draft_tree):
    """The sampling oracle (chi-square) through the compiled, padded rounds (3 new tokens after a 4-token block: the round
    after the prefill fits one draft and is padded), chains and sampled trees."""
    from tests.helpers.generation import check_sampled_second_token

    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.draft_tree = draft_tree
    spy = WidthSpy(target)
    compiled = dict(cache_implementation="static", compile_config=cpu_compile_config(), max_cache_len=5 + 3 + 4)
    check_sampled_second_token(target, drafter, "compiled generate(do_sample)", draws=600, **compiled)
    assert spy.widths and set(spy.widths) == {4}


def repeating_prompt(seed: int, length: int = 12) -> torch.LongTensor:
    """A random span written three times: the n-gram branch of hybrid drafting finds continuations."""
    from tests.helpers.hybrid import prompt as hybrid_prompt

    return hybrid_prompt(seed, repeats=True, length=length)


TREE_SETUPS = {  # name: (drafter.draft_tree, prompt_lookup_num_tokens, the compiled round width)
    "tree": (6, None, 6),
    "tree-sized-per-round": ("sized", None, 6),  # TreeDrafting(6, seconds=...): sizes vary, padded to 6
    "hybrid": (None, 3, 4 + 3),
    "hybrid-tree": (5, 3, 5 + 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", sorted(TREE_SETUPS))
def test_compiled_trees_and_hybrid_rounds_have_one_shape_and_match_plain_greedy(setup, monkeypatch):
    """Draft trees and hybrid drafting over a static cache: every compiled round is a tree of one width
    (chains included, padding nodes hung below the last node, the tree mask spanning the static cache), the
    accepted path is gathered in place, and the output is plain greedy's."""
    nodes, ngram, width = TREE_SETUPS[setup]
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    if nodes == "sized":
        from hf_dflash.generation.policies.tree_size import TreeDrafting

        nodes = TreeDrafting(6, top_k=4, seconds=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.6, 1.6]))
    if nodes is not None:
        drafter.draft_tree = nodes
    tree_forwards = []
    tree_inputs = target_forward.tree_inputs
    monkeypatch.setattr(
        target_forward, "tree_inputs", lambda *a, **k: tree_forwards.append(a[2]) or tree_inputs(*a, **k)
    )
    spy = WidthSpy(target)
    lookup = {} if ngram is None else {"prompt_lookup_num_tokens": ngram}
    for seed in range(2):
        input_ids = repeating_prompt(seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=29, eos_token_id=None)
        room = input_ids.shape[1] + 29 + width
        actual = compiled_dflash(target, drafter, input_ids, 29, max_cache_len=room, **lookup)
        assert torch.equal(actual, expected)
    assert spy.widths and set(spy.widths) == {width}
    real_trees = [parents for parents in tree_forwards if any(p != i - 1 for i, p in enumerate(parents))]
    assert real_trees  # some rounds verified a tree, not a chain
    assert all(len(parents) == width for parents in tree_forwards[-len(spy.widths) :])


def test_trees_over_a_static_cache_without_compile_match_plain_greedy():
    """A static cache with room for a tree beyond max_length verifies trees (the tree mask spans its slots);
    without that room, chains, with a warning naming it. Both lossless."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.draft_tree = 8
    input_ids = prompt(5, length=7)
    expected = plain_greedy(target, input_ids, max_new_tokens=25, eos_token_id=None)
    static = dict(assistant_model=drafter, cache_implementation="static", do_sample=False, eos_token_id=None)
    with pytest.warns(UserWarning, match="static cache without 8 slots beyond max_length"):
        actual = target.generate(input_ids, max_new_tokens=25, **static)  # default: max_length slots
    assert torch.equal(actual, expected)
    assert not drafter.last_acceptance.tree_sizes  # chains
    with warnings.catch_warnings():  # (generate reuses a static cache only when it is large enough)
        warnings.simplefilter("error", UserWarning)
        actual = target.generate(input_ids, max_new_tokens=25, max_cache_len=7 + 25 + 8, **static)
    assert torch.equal(actual, expected)
    assert max(drafter.last_acceptance.tree_sizes) > 4  # trees, not chains of the block


def batched_static(target, drafter, input_ids, attention_mask, max_new_tokens, eos, **kwargs):
    from tests.helpers.generation import PAD

    common = dict(attention_mask=attention_mask, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    expected = target.generate(input_ids, max_new_tokens=max_new_tokens, **common)
    actual = target.generate(
        input_ids, max_new_tokens=max_new_tokens, assistant_model=drafter, cache_implementation="static",
        **common, **kwargs,
    )  # fmt: skip
    return actual, expected


@pytest.mark.parametrize("headroom", [0, 16])
def test_batched_dflash_over_a_static_cache_matches_plain_batched_greedy(headroom, monkeypatch):
    """Batch N over a static cache: finished rows stay in it idle (a static cache keeps its batch), and the
    holes of rejected drafts are compacted in place when the next round would not fit."""
    from hf_dflash import caches
    from tests.helpers.generation import eos_mid_way, random_batch

    compactions = []
    compact = caches.compact_cache
    monkeypatch.setattr(target_slots, "compact_cache", lambda *a: compactions.append(1) or compact(*a))
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)  # random: rows accept different counts, holes appear
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        input_ids, attention_mask = random_batch(generator, 3)
        eos = eos_mid_way(target, input_ids, attention_mask, 24, generator)  # rows finish at different rounds
        room = {"max_cache_len": input_ids.shape[1] + 24 + headroom}
        actual, expected = batched_static(target, drafter, input_ids, attention_mask, 24, eos, **room)
        assert torch.equal(actual, expected)
    assert bool(compactions) == (headroom == 0)  # without headroom the holes had to be compacted


@pytest.mark.slow
def test_compiled_batched_rounds_have_one_shape_and_match_plain_batched_greedy():
    from tests.helpers.generation import eos_mid_way, random_batch

    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    spy = WidthSpy(target)
    generator = torch.Generator().manual_seed(8)
    for _ in range(2):
        input_ids, attention_mask = random_batch(generator, 3)
        eos = eos_mid_way(target, input_ids, attention_mask, 21, generator)
        room = {"max_cache_len": input_ids.shape[1] + 21 + 4, "compile_config": cpu_compile_config()}
        actual, expected = batched_static(target, drafter, input_ids, attention_mask, 21, eos, **room)
        assert torch.equal(actual, expected)
    assert spy.widths and set(spy.widths) == {4}


@pytest.mark.slow
@pytest.mark.parametrize("ngram", [None, 3])
def test_one_size_trees_compile_the_width_their_first_tree_chose(ngram, monkeypatch):
    """ "auto" trees under compile (`TreeDrafting(one_size=True)`): the first tree chooses its size on the cost
    curve (before its round's verification; rounds without a tree before it run eager), then every compiled
    round verifies that size (+ the n-gram drafts, the hybrid budget re-weighed at that width); the output
    is plain greedy's."""
    from hf_dflash.generation.policies.block_size import AdaptiveBlockSize
    from hf_dflash.generation.policies.cost_model import CostModel
    from hf_dflash.generation.policies.hybrid_budget import TreeBudget
    from hf_dflash.generation.policies.tree_size import TreeDrafting

    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    # verification flat in width (as compiled rounds are): drafting pays, the budget drafts the tree
    cost = CostModel.from_function(lambda k: 0.01 + 0.001 * k, 4, lambda n: 0.01, 64)
    drafter.block_size_policy = 4 if ngram is None else AdaptiveBlockSize(cost_model=cost)
    drafter.draft_tree = TreeDrafting(
        16, top_k=4, seconds=torch.tensor([1.0] * 7 + [50.0] * 9), min_nodes=4, one_size=True
    )
    widths = []
    verify_at = TreeBudget.verify_at
    monkeypatch.setattr(TreeBudget, "verify_at", lambda self, width: widths.append(width) or verify_at(self, width))
    spy = WidthSpy(target)
    input_ids = repeating_prompt(0)
    expected = plain_greedy(target, input_ids, max_new_tokens=29, eos_token_id=None)
    lookup = {} if ngram is None else {"prompt_lookup_num_tokens": ngram}
    room = input_ids.shape[1] + 29 + 16 + (ngram or 0)
    actual = compiled_dflash(target, drafter, input_ids, 29, max_cache_len=room, **lookup)
    assert torch.equal(actual, expected)
    width = 7 + (ngram or 0)  # free up to 7 nodes, 50x dearer beyond
    # rounds with drafts verify one width; the hybrid's adaptive budget may also take plain steps (width 1)
    assert drafter.draft_tree.max_nodes == 7 and spy.widths and set(spy.widths) - {1} == {width}
    assert widths == ([] if ngram is None else [width])


@pytest.mark.slow
def test_auto_trees_under_compile_keep_their_size_across_calls():
    """`draft_tree="auto"` under compile: the first call's first tree chooses the size, the drafter keeps it
    (`compiled_draft_tree`) and later calls reuse it, so every compiled round of every call has one width
    (a new size would compile a new graph); each output is plain greedy's."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    drafter.draft_tree = "auto"
    spy = WidthSpy(target)
    for seed in range(3):
        input_ids = repeating_prompt(seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=17, eos_token_id=None)
        room = input_ids.shape[1] + 17 + 64  # "auto" considers trees of up to 64 nodes
        assert torch.equal(compiled_dflash(target, drafter, input_ids, 17, max_cache_len=room), expected)
    assert 4 <= drafter.compiled_draft_tree <= 64 and spy.widths and set(spy.widths) == {drafter.compiled_draft_tree}
