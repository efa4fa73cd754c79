"""Recursive rejection sampling through a draft tree (`multi_draft_sample_path`): whatever the tree's shape and
however its drafts were drawn (from distributions q, or deterministically: one-hot q), the committed tokens follow
the target's distribution (chi-square per position), and drafts are accepted as often as the rule promises."""

import pytest
import torch
from scipy.stats import chisquare

from hf_dflash.generation.drafting.draft_tree import merge_branches
from hf_dflash.generation.verifying.tree_verification import multi_draft_sample_path
from tests.helpers.generation import ALPHA

VOCAB = 6


def distributions(generator, count: int) -> list[torch.Tensor]:
    return [torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, -1) for _ in range(count)]


def one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()


def draw_branches(shape: str, q: list[torch.Tensor], generator) -> list[list[tuple[int, torch.Tensor]]]:
    """The branches of one round as [(token, the distribution it was drawn from)] per draft, by tree shape."""
    sampled = lambda dist: (int(torch.multinomial(dist, 1, generator=generator)), dist)  # noqa: E731
    fixed = lambda token: (token, one_hot(token))  # noqa: E731
    if shape == "sampled-chain+ngram":  # the hybrid under sampling
        return [[sampled(q[0]), sampled(q[1])], [fixed(2), fixed(4)]]
    if shape == "three-sampled-children":  # SpecInfer-style: several drafts from their own q at the root
        return [[sampled(q[0]), fixed(1)], [sampled(q[1]), fixed(3)], [sampled(q[2])]]
    if shape == "deterministic-tree":  # a top-k tree: every draft fixed
        return [[fixed(0), fixed(1)], [fixed(0), fixed(5)], [fixed(3)], [fixed(4), fixed(4)]]
    raise AssertionError(shape)


@pytest.mark.parametrize("shape", ["sampled-chain+ngram", "three-sampled-children", "deterministic-tree"])
def test_every_committed_position_follows_the_target(shape):
    """The target's distribution depends on the depth only (p1 after the root, p2 after a depth-1 node), so the
    first committed token must follow p1 and the second, whenever there is one, p2."""
    generator = torch.Generator().manual_seed(0)
    p1, p2 = distributions(generator, 2)
    q = distributions(generator, 3)
    draws, accepted = 12000, 0
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(draws):
        branches = draw_branches(shape, q, generator)
        tree = merge_branches(0, [torch.tensor([token for token, _ in branch]) for branch in branches])
        draft_probs = torch.zeros(tree.num_nodes, VOCAB)
        for branch, nodes in reversed(list(zip(branches, tree.branches))):  # a shared node keeps branch 0's q
            for (_, dist), node in zip(branch, nodes):
                draft_probs[node] = dist
        target_probs = torch.stack([p1] + [p2] * (tree.num_nodes - 1))
        path, last = multi_draft_sample_path(tree, target_probs, draft_probs, generator)
        committed = tree.tokens[path[1:]].tolist() + last.tolist()
        accepted += len(path) - 1
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1
    assert chisquare(first, p1 * draws).pvalue > ALPHA
    assert chisquare(second, p2 * second.sum()).pvalue > ALPHA
    assert accepted > draws // 10  # acceptance exercised, not only the residual


def test_deterministic_children_are_accepted_with_their_target_mass():
    """One-hot drafts: the walk steps into some child with probability sum of p over the children's tokens."""
    generator = torch.Generator().manual_seed(1)
    (p,) = distributions(generator, 1)
    tree = merge_branches(0, [torch.tensor([1]), torch.tensor([4]), torch.tensor([5])])
    draft_probs = torch.stack([torch.zeros(VOCAB)] + [one_hot(int(t)) for t in tree.tokens[1:]])
    draws = 20000
    stepped = sum(
        len(multi_draft_sample_path(tree, p.expand(4, -1), draft_probs, generator)[0]) > 1 for _ in range(draws)
    )
    assert stepped / draws == pytest.approx(float(p[[1, 4, 5]].sum()), abs=0.015)
