"""The draft-tree maths (`hf_dflash.generation.drafting.draft_tree`, `.verifying.tree_verification` and
`.target_slots.keep_tree_path`): merging branches, depths, the attention mask, the longest accepted path, the
per-node logits processing and the cache gather, each against a hand-made or
brute-force oracle; and one tree forward of a real (tiny) target against each branch run as a chain."""

import inspect

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

from hf_dflash.generation.drafting.draft_tree import (
    DraftTree,
    chain_parents,
    merge_branches,
    padded_parents,
    tree_depths,
)
from hf_dflash.generation.target_slots import keep_tree_path
from hf_dflash.generation.verifying.tree_verification import (
    ancestor_mask,
    greedy_tree_path,
    process_tree_logits,
    tree_attention_bias,
)
from tests.conftest import ARCHITECTURES, VOCAB, make_target


def tokens(*values) -> torch.LongTensor:
    return torch.tensor(values, dtype=torch.long)


# --- merging branches into a trie ---


def test_merge_branches_shares_common_prefixes_and_lays_out_the_first_branch_first():
    tree = merge_branches(9, [tokens(5, 6, 7), tokens(5, 6, 8, 1), tokens(4)])
    # node: 0=root 9, 1=5, 2=6, 3=7 (branch 0), 4=8, 5=1 (branch 1 after its shared 5, 6), 6=4 (branch 2)
    assert tree.tokens.tolist() == [9, 5, 6, 7, 8, 1, 4]
    assert tree.parents == (-1, 0, 1, 2, 2, 4, 0)
    assert tree.branches == ((1, 2, 3), (1, 2, 4, 5), (6,))
    assert not tree.is_chain and tree.num_nodes == 7


def test_one_branch_or_identical_branches_give_a_chain():
    chain = merge_branches(3, [tokens(1, 2, 3)])
    assert chain.is_chain and chain.parents == (-1, 0, 1, 2)
    same = merge_branches(3, [tokens(1, 2), tokens(1, 2, 5)])  # the second extends the first
    assert same.is_chain and same.tokens.tolist() == [3, 1, 2, 5] and same.branches == ((1, 2), (1, 2, 3))
    empty = merge_branches(3, [tokens(), tokens()])
    assert empty.is_chain and empty.num_nodes == 1 and empty.branches == ((), ())


def test_repeated_tokens_inside_a_branch_stay_separate_nodes():
    tree = merge_branches(1, [tokens(2, 2, 2), tokens(2, 3)])
    assert tree.tokens.tolist() == [1, 2, 2, 2, 3] and tree.parents == (-1, 0, 1, 2, 1)


def test_draft_tree_refuses_a_parent_after_its_child():
    with pytest.raises(ValueError, match="parents"):
        DraftTree(tokens(1, 2, 3), (-1, 2, 0), ((1,),))


# --- depths and masks (brute force: walk the parents) ---


def ancestors(parents, node) -> set[int]:
    seen = {node}
    while parents[node] >= 0:
        node = parents[node]
        seen.add(node)
    return seen


def test_depths_and_ancestor_mask_match_walking_the_parents():
    parents = (-1, 0, 1, 2, 2, 4, 0, 6, 1)
    depths = tree_depths(parents)
    mask = ancestor_mask(parents)
    for node in range(len(parents)):
        assert depths[node] == len(ancestors(parents, node)) - 1
        assert set(mask[node].nonzero()[:, 0].tolist()) == ancestors(parents, node)


def test_attention_bias_sees_the_whole_context_and_the_ancestors_only():
    parents = (-1, 0, 0, 2)
    bias = tree_attention_bias(parents, past_length=3, dtype=torch.float32, device=torch.device("cpu"))
    assert bias.shape == (1, 1, 4, 7)
    visible = bias[0, 0] == 0
    assert visible[:, :3].all()
    assert visible[:, 3:].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, False, True, True],
    ]
    assert (bias[0, 0][~visible] == torch.finfo(torch.float32).min).all()


def test_chain_mask_is_causal():
    mask = ancestor_mask((-1, 0, 1, 2, 3))
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


# --- the longest accepted path ---


def brute_force_path(tree: DraftTree, target_tokens: list[int]) -> list[int]:
    """Over every root-to-node path, the longest one all of whose drafts equal the target's token after
    their parent (the children of a node carry distinct tokens, so it is unique)."""
    best = [0]
    for node in range(tree.num_nodes):
        path = sorted(ancestors(tree.parents, node))
        if all(tree.tokens[child] == target_tokens[tree.parents[child]] for child in path[1:]) and len(path) > len(
            best
        ):
            best = path
    return best


def test_greedy_tree_path_matches_brute_force_on_random_trees():
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        branches = [
            torch.randint(0, 3, (int(torch.randint(0, 6, (1,), generator=generator)),), generator=generator)
            for _ in range(int(torch.randint(1, 4, (1,), generator=generator)))
        ]
        tree = merge_branches(0, branches)
        target_tokens = torch.randint(0, 3, (tree.num_nodes,), generator=generator)
        assert greedy_tree_path(tree, target_tokens) == brute_force_path(tree, target_tokens.tolist())


def test_greedy_tree_path_follows_the_second_branch():
    tree = merge_branches(9, [tokens(5, 6, 7), tokens(5, 6, 8, 1)])  # nodes 9 5 6 7 8 1
    #                                 after: 9  5  6  7  8  1
    assert greedy_tree_path(tree, tokens(5, 6, 8, 0, 1, 4)) == [0, 1, 2, 4, 5]
    assert greedy_tree_path(tree, tokens(5, 6, 7, 3, 0, 0)) == [0, 1, 2, 3]
    assert greedy_tree_path(tree, tokens(4, 0, 0, 0, 0, 0)) == [0]


# --- logits processing per node ---


def test_process_tree_logits_uses_each_nodes_own_prefix():
    tree = merge_branches(7, [tokens(3, 4), tokens(5)])  # nodes: 7, 3, 4, 5 with parents -1, 0, 1, 0
    sequence = tokens(1, 2, 7)[None]  # committed tokens, ending with the root
    logits = torch.randn(1, tree.num_nodes, VOCAB, generator=torch.Generator().manual_seed(1))
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.7)])  # reads input_ids
    processed = process_tree_logits(penalty, sequence, tree, logits)
    prefixes = [[1, 2, 7], [1, 2, 7, 3], [1, 2, 7, 3, 4], [1, 2, 7, 5]]
    for node, prefix in enumerate(prefixes):
        torch.testing.assert_close(processed[:, node], penalty(torch.tensor([prefix]), logits[:, node].clone()))
    warper = LogitsProcessorList([TemperatureLogitsWarper(0.5)])  # position independent: one vectorised call
    torch.testing.assert_close(process_tree_logits(warper, sequence, tree, logits), logits / 0.5)
    assert process_tree_logits(None, sequence, tree, logits) is not None


# --- keeping the accepted path in the cache ---


def filled_cache(past: int, nodes: int, layers: int = 2) -> DynamicCache:
    """A cache whose key/value slot s holds the value s in every entry (B=1, H=2, D=3)."""
    cache = DynamicCache()
    slots = torch.arange(past + nodes, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 3).contiguous()
    for layer in range(layers):
        cache.update(slots[:, :, :past].clone(), -slots[:, :, :past].clone(), layer)
        cache.update(slots[:, :, past:].clone(), -slots[:, :, past:].clone(), layer)
    return cache


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 2, 3], [0, 4], [0, 1, 3, 4]])
def test_keep_tree_path_keeps_the_context_and_the_path_in_order(keep):
    past, nodes = 5, 5
    cache = filled_cache(past, nodes)
    keep_tree_path(cache, nodes, keep)
    expected = list(range(past)) + [past + node for node in keep]
    assert cache.get_seq_length() == len(expected)
    for layer in cache.layers:
        assert layer.keys[0, 1, :, 2].tolist() == expected
        assert layer.values[0, 0, :, 0].tolist() == [-float(s) for s in expected]


def test_keep_tree_path_refuses_a_path_that_is_not_increasing():
    with pytest.raises(ValueError, match="increasing"):
        keep_tree_path(filled_cache(2, 3), 3, [0, 2, 1])


# --- one tree forward of a real target == each branch as a chain ---


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@torch.no_grad()
def test_tree_forward_matches_each_branch_verified_alone(arch, attn):
    """The logits and hidden states of every tree node, from ONE forward with the tree mask and depth
    positions, equal those of a plain causal forward over context + that node's path; and after keeping
    a path, the cache continues exactly like the cache of the context + that path."""
    target = make_target(arch)
    target.set_attn_implementation(attn)
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(3, VOCAB, (1, 9), generator=generator)
    tree = merge_branches(int(context[0, -1]), [tokens(11, 12, 13, 14), tokens(11, 12, 20), tokens(30, 31)])
    cache = DynamicCache(config=target.config)
    # Transformers 5.24 names the forward's cache argument `cache`, 5.23 `past_key_values`
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    target(context[:, :-1], use_cache=True, **{name: cache})
    past = context.shape[1] - 1
    out = target(
        tree.tokens[None],
        use_cache=True,
        **{name: cache},
        attention_mask=tree_attention_bias(tree.parents, past, target.dtype, target.device),
        position_ids=(past + tree_depths(tree.parents))[None],
        output_hidden_states=True,
    )
    for node in range(tree.num_nodes):
        path = sorted(ancestors(tree.parents, node))
        sequence = torch.cat([context[:, :-1], tree.tokens[path][None]], 1)
        reference = target(sequence, output_hidden_states=True)
        torch.testing.assert_close(out.logits[0, node], reference.logits[0, -1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            out.hidden_states[3][0, node], reference.hidden_states[3][0, -1], rtol=1e-4, atol=1e-5
        )
    keep = [0, 6, 7]  # root -> 30 -> 31 (the third branch: not contiguous in the layout)
    keep_tree_path(cache, tree.num_nodes, keep)
    following = tokens(40, 41)[None]
    continued = target(following, use_cache=True, **{name: cache}).logits
    expected = target(torch.cat([context[:, :-1], tree.tokens[keep][None], following], 1)).logits[:, -2:]
    torch.testing.assert_close(continued, expected, rtol=1e-4, atol=1e-5)


# --- the drafter's own tree: best-first over the block's per-slot distributions ---


def all_continuations(token_ids, log_probs):
    """Brute force: every continuation of length 1..L over the K tokens per slot, with its log-probability."""
    import itertools

    length, width = token_ids.shape
    out = []
    for depth in range(1, length + 1):
        for ranks in itertools.product(range(width), repeat=depth):
            tokens_ = tuple(int(token_ids[d, r]) for d, r in enumerate(ranks))
            out.append((float(sum(log_probs[d, r] for d, r in enumerate(ranks))), tokens_))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_nodes", [1, 2, 5, 12, 40])
def test_best_first_tree_holds_the_most_probable_continuations(seed, max_nodes):
    from hf_dflash.generation.drafting.draft_tree import best_first_tree

    generator = torch.Generator().manual_seed(seed)
    length, width = 3, 3
    log_probs = torch.randn(length, width, generator=generator, dtype=torch.float64).sort(-1, descending=True).values
    log_probs = log_probs - log_probs.exp().sum(-1, keepdim=True).log()  # valid log-probabilities (< 0)
    token_ids = torch.randperm(VOCAB, generator=generator)[: length * width].view(length, width)
    tree, reach = best_first_tree(7, token_ids, log_probs, max_nodes)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    continuations = sorted(all_continuations(token_ids, log_probs), reverse=True)
    expected = {tokens_ for _, tokens_ in continuations[: max_nodes - 1]}
    got = set()
    for node in range(1, tree.num_nodes):  # each node's continuation: the tokens on its path
        path, walk = [], node
        while walk > 0:
            path.append(int(tree.tokens[walk]))
            walk = tree.parents[walk]
        got.add(tuple(path[::-1]))
        assert reach[node] <= reach[tree.parents[node]]  # never likelier than its prefix
    assert got == expected and tree.num_nodes == min(max_nodes, 1 + len(continuations))
    assert (reach[1:].diff() <= 1e-12).all()  # best-first: nodes in decreasing probability


def test_accepted_path_follows_the_continuation_as_far_as_the_tree_holds_it():
    from hf_dflash.generation.drafting.draft_tree import accepted_path

    tree = merge_branches(9, [tokens(5, 6, 7), tokens(5, 8), tokens(4)])  # 9 -> 5 -> {6 -> 7, 8}; 9 -> 4
    assert accepted_path(tree, [5, 6, 7, 3]) == [0, 1, 2, 3]
    assert accepted_path(tree, [5, 8, 1]) == [0, 1, 4]
    assert accepted_path(tree, [4]) == [0, 5]
    assert accepted_path(tree, [2, 5]) == [0]
    assert accepted_path(tree, []) == [0]


def test_padded_trees_and_masks_over_static_slots():
    """Compiled rounds pad a tree to one size (padding nodes chained below the last node, never an ancestor of
    a real node) and mask a static cache's empty slots."""
    assert chain_parents(4) == (-1, 0, 1, 2)
    parents = padded_parents((-1, 0, 0, 1), 3)
    assert parents == (-1, 0, 0, 1, 3, 4, 5)
    assert not ancestor_mask(parents)[:4, 4:].any()  # real nodes see no padding
    bias = tree_attention_bias((-1, 0, 0), 2, torch.float32, torch.device("cpu"), key_slots=8)
    assert bias.shape == (1, 1, 3, 8)
    visible = bias[0, 0] == 0
    assert visible[:, :2].all() and not visible[:, 5:].any()  # context seen, empty slots never
    assert visible[2, 2] and not visible[2, 3] and visible[2, 4]  # node 2 sees the root and itself only
    with pytest.raises(ValueError, match="does not fit 4 key slots"):
        tree_attention_bias((-1, 0, 0), 2, torch.float32, torch.device("cpu"), key_slots=4)
