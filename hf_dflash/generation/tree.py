"""Pure functions of a draft tree: merging branches, depths, the attention mask, the longest accepted
path, per-node logits processing, and keeping the accepted path in the target cache.

A draft tree of N nodes: node 0 is the root (the bonus token: committed, not yet read by the target),
every other node a drafted token. parents (N,): parents[0] = -1 and parents[i] < i, so the nodes can be
verified in this order and every root-to-node path is increasing. A chain (parents[i] = i - 1) is the
tree of one branch: verifying it is ordinary block verification.

Verification reads all N nodes in ONE target forward: node i sits at position past + depth(i) and
attends to the whole committed context and to its own ancestors (itself included), so its logits and
hidden states equal those of a causal forward over context + the path to i.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import Cache

from .verification import is_position_independent, process_draft_logits


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


def ancestor_mask(parents: Sequence[int]) -> torch.BoolTensor:
    """(N, N) bool: [i, j] = node j is node i or one of its ancestors (lower-triangular; causal for a chain)."""
    size = len(parents)
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        mask[node] |= mask[parents[node]]
    return mask


def tree_attention_bias(
    parents: Sequence[int], past_length: int, dtype: torch.dtype, device: torch.device, key_slots: int | None = None
) -> torch.Tensor:
    """(1, 1, N, S) additive attention mask for the tree forward over S key slots (default past_length + N;
    a static cache's whole length, whose slots after the tree hold nothing yet): 0 where a node may look (the
    committed context and its ancestors), the dtype's minimum elsewhere. Transformers passes a 4D mask to
    the attention as is; eager and SDPA both add a float mask to the scores."""
    size = len(parents)
    empty = (key_slots or past_length + size) - past_length - size
    if empty < 0:
        raise ValueError(f"A tree of {size} nodes after {past_length} slots does not fit {key_slots} key slots.")
    visible = torch.cat(
        [
            torch.ones(size, past_length, dtype=torch.bool),
            ancestor_mask(parents),
            torch.zeros(size, empty, dtype=torch.bool),
        ],
        1,
    )
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return bias.to(device)[None, None]


def greedy_tree_path(tree: DraftTree, target_tokens: torch.LongTensor) -> list[int]:
    """The longest accepted path, root first: from the root, step to the child whose token is the target's
    greedy token after the current node, while there is one. target_tokens (N,): the target's choice after
    each node. The committed tokens are tokens[path[1:]] followed by target_tokens[path[-1]]."""
    children = tree.children
    choices = target_tokens.tolist()
    path = [0]
    while (child := children[path[-1]].get(choices[path[-1]])) is not None:
        path.append(child)
    return path


def sampled_tree_path(tree: DraftTree, target_probs: torch.Tensor) -> tuple[list[int], torch.LongTensor]:
    """Sampling through a tree: at each node (from the root) draw the target's next token from its own
    distribution; step to the child holding it, or stop and commit it. target_probs (N, V): the target's
    (processed) distribution after each node. Every committed token is drawn from the target, so the
    output is distributed exactly as plain sampling's; with deterministic candidates (a tree of the top
    continuations, an n-gram copy) this is also the most a node's children can be accepted (their target
    mass). Returns the path (root first) and the committed token after its last node (1,)."""
    children = tree.children
    path = [0]
    while True:
        token = torch.multinomial(target_probs[path[-1]], 1)
        child = children[path[-1]].get(int(token))
        if child is None:
            return path, token
        path.append(child)


def node_prefix(sequence: torch.LongTensor, tree: DraftTree, node: int) -> torch.LongTensor:
    """(1, L + depth): the committed tokens (ending with the root) followed by the drafts on the path to `node`."""
    path = []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return torch.cat([sequence, tree.tokens[path[::-1]][None].to(sequence.device)], 1)


def process_tree_logits(
    logits_processor: LogitsProcessorList | None, sequence: torch.LongTensor, tree: DraftTree, logits: torch.Tensor
) -> torch.Tensor:
    """Apply `logits_processor` to each node's logits with that node's own prefix, as plain decoding would.

    sequence (1, L) is committed and ends with the root; logits (1, N, V) are the scores after each node.
    Returns float32 (1, N, V); position-independent processors run once over all nodes.
    """
    if not logits_processor or is_position_independent(logits_processor):
        return process_draft_logits(logits_processor, sequence, logits)
    logits = logits.float()
    return torch.stack(
        [logits_processor(node_prefix(sequence, tree, node), logits[:, node]) for node in range(logits.shape[1])], 1
    )


def keep_tree_path(cache: Cache, num_nodes: int, keep: Sequence[int]) -> None:
    """Keep, of the `num_nodes` tree entries that end every layer of `cache`, only the nodes `keep`
    (increasing, root first), in that order; the context before the tree is untouched.

    A path that is a prefix of the layout (0, 1, ..., n) is a crop. Otherwise the kept entries are copied
    into the first len(keep) tree slots in place (O(path), not O(cache)) and the rest cropped, so the
    cache's own `crop` keeps its bookkeeping (a sliding-window layer's length) right.
    """
    keep = list(keep)
    if not keep or any(b <= a for a, b in zip(keep, keep[1:])) or keep[0] != 0 or keep[-1] >= num_nodes:
        raise ValueError(f"keep_tree_path: keep={keep} must be increasing node ids from 0 below {num_nodes}.")
    if keep != list(range(len(keep))):
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            start = int(layer.get_seq_length()) - num_nodes  # static layers: their write position
            index = torch.tensor(keep, device=layer.keys.device) + start
            layer.keys[..., start : start + len(keep), :] = layer.keys[..., index, :]
            layer.values[..., start : start + len(keep), :] = layer.values[..., index, :]
    cache.crop(-(num_nodes - len(keep)))
