"""What a draft tree is and how one is built: merging branches, best-first trees, depths, parents, and the
path of a known continuation through it. How the target verifies one is `verifying/tree_verification.py`.

A draft tree of N nodes: node 0 is the root (the bonus token: committed, not yet read by the target),
every other node a drafted token. parents (N,): parents[0] = -1 and parents[i] < i, so the nodes can be
verified in this order and every root-to-node path is increasing. A chain (parents[i] = i - 1) is the
tree of one branch: verifying it is ordinary block verification.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DraftTree:
    """tokens (N,): node 0 = root; parents (N,) as in the module docstring; branches: for each branch
    that was merged, the node of each of its drafts in order (branch b's j-th draft is node branches[b][j])."""

    tokens: torch.LongTensor
    parents: tuple[int, ...]
    branches: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if len(self.parents) != len(self.tokens) or self.parents[:1] != (-1,):
            raise ValueError(f"DraftTree: parents {self.parents} must start with -1 and give one parent per token.")
        if any(not 0 <= parent < node for node, parent in enumerate(self.parents) if node):
            raise ValueError(f"DraftTree: parents {self.parents} must satisfy 0 <= parents[i] < i for i >= 1.")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def children(self) -> list[dict[int, int]]:
        """children[node]: {token: child node} (a trie: one child per token)."""
        children: list[dict[int, int]] = [{} for _ in range(self.num_nodes)]
        values = self.tokens.tolist()
        for node in range(1, self.num_nodes):
            children[self.parents[node]][values[node]] = node
        return children

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))


def merge_branches(root: int, branches: Sequence[torch.LongTensor], base: DraftTree | None = None) -> DraftTree:
    """The trie of `branches` (each (n_b,) drafted tokens following `root`): a shared prefix becomes shared
    nodes. Nodes are numbered in order of first appearance, so branch 0 occupies nodes 1..n_0 (an
    accepted path inside it is a prefix of the layout: the cache is then cropped, not gathered).
    With a `base` tree (same root), its nodes keep their numbers and the branches are grafted onto it;
    the result's branches are the base's followed by these."""
    device = branches[0].device if branches else torch.device("cpu")
    values, parents, children, layout = [int(root)], [-1], [{}], []
    if base is not None:
        device = base.tokens.device
        values, parents, layout = base.tokens.tolist(), list(base.parents), list(base.branches)
        children = [dict(nodes) for nodes in base.children]
    for branch in branches:
        node, nodes = 0, []
        for token in branch.tolist():
            child = children[node].get(token)
            if child is None:
                child = len(values)
                values.append(token)
                parents.append(node)
                children.append({})
                children[node][token] = child
            nodes.append(child)
            node = child
        layout.append(tuple(nodes))
    return DraftTree(torch.tensor(values, dtype=torch.long, device=device), tuple(parents), tuple(layout))


# children(parent token, slot) -> the slot's candidates after that parent: (log-probabilities, descending; ids)
Children = Callable[[int, int], tuple[list[float], list[int]]]


def best_first_tree(
    root: int, token_ids: torch.LongTensor, log_probs: torch.Tensor, max_nodes: int
) -> tuple[DraftTree, torch.Tensor]:
    """The draft tree of the `max_nodes` most probable continuations of a DFlash block (DDTree's tree).

    A block's draft slots are drafted in one pass, independently given the context, so a continuation
    t_1..t_d has probability prod_i q_i(t_i). token_ids, log_probs (L, K): the K best tokens of each of the
    L draft slots, log-probabilities descending. See `best_first_tree_by` (the same slot candidates after
    every parent).
    """
    scores, ids = log_probs.tolist(), token_ids.tolist()
    tree, reach = best_first_tree_by(root, token_ids.shape[0], lambda token, slot: (scores[slot], ids[slot]), max_nodes)
    return DraftTree(tree.tokens.to(token_ids.device), tree.parents, ()), reach


def best_first_tree_by(root: int, length: int, children: Children, max_nodes: int) -> tuple[DraftTree, torch.Tensor]:
    """The tree of root + the `max_nodes` - 1 most probable continuations (lengths 1..`length`) when slot l's
    candidates after a node holding token t are `children(t, l)` (log-probabilities descending, ids): the same
    for every parent (DFlash), or conditioned on it (DFlash2's selector). A continuation is never likelier
    than its prefix, so these are prefix-closed. Found best-first with a heap (each node pushes its best
    child and its next sibling), so nodes come in decreasing probability: parents before children, and the
    tree of n < max_nodes nodes is the first n nodes. Returns the tree (branches: none) and the (N,)
    log-probability of reaching each node (0 for the root).
    """
    values, parents, reach, offered = [int(root)], [-1], [0.0], [None]  # offered: each node's children
    heap = []  # (-log p, parent, slot, rank)
    if length and max_nodes > 1:
        offered[0] = children(int(root), 0)
        heap = [(-offered[0][0][0], 0, 0, 0)] if offered[0][0] else []
    while heap and len(values) < max_nodes:
        negative, parent, slot, rank = heapq.heappop(heap)
        scores, ids = offered[parent]
        node = len(values)
        values.append(ids[rank])
        parents.append(parent)
        reach.append(-negative)
        offered.append(children(ids[rank], slot + 1) if slot + 1 < length else None)
        if offered[node] is not None and offered[node][0]:  # its best child
            heapq.heappush(heap, (negative - offered[node][0][0], node, slot + 1, 0))
        if rank + 1 < len(scores):  # its next sibling
            heapq.heappush(heap, (-reach[parent] - scores[rank + 1], parent, slot, rank + 1))
    tree = DraftTree(torch.tensor(values, dtype=torch.long), tuple(parents), ())
    return tree, torch.tensor(reach, dtype=torch.float64)


def accepted_path(tree: DraftTree, continuation: Sequence[int]) -> list[int]:
    """The nodes of the longest prefix of `continuation` (the tokens the target commits after the root, in
    order) that the tree holds, root first: what greedy verification of this tree accepts."""
    children = tree.children
    path = [0]
    for token in continuation:
        child = children[path[-1]].get(int(token))
        if child is None:
            break
        path.append(child)
    return path


def tree_depths(parents: Sequence[int]) -> torch.LongTensor:
    """(N,) depth of each node (root 0): its position is past_length + depth."""
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return torch.tensor(depths, dtype=torch.long)


def chain_parents(num_nodes: int) -> tuple[int, ...]:
    """The parents of a chain of `num_nodes` nodes: (-1, 0, 1, ..., num_nodes - 2)."""
    return tuple(range(-1, num_nodes - 1))


def padded_parents(parents: Sequence[int], padding: int) -> tuple[int, ...]:
    """`parents` followed by `padding` nodes chained after the last one: a tree padded to a fixed node count
    (compiled verification). No real node has them as ancestors, so they change no real node's output."""
    size = len(parents)
    return tuple(parents) + tuple(range(size - 1, size - 1 + padding))
