"""How the target verifies a draft tree: the attention mask of its ONE forward, the longest path it accepts
(greedy, sampled against deterministic drafts, or by recursive rejection sampling against drafts drawn from known
distributions), and per-node logits processing. What a draft tree is: `drafting/draft_tree.py`.

Verification reads all N nodes in ONE target forward: node i sits at position past + depth(i) and
attends to the whole committed context and to its own ancestors (itself included), so its logits and
hidden states equal those of a causal forward over context + the path to i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessorList

from ..drafting.draft_tree import DraftTree
from .acceptance_rules import is_position_independent, process_draft_logits


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


def multi_draft_sample_path(
    tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], torch.LongTensor]:
    """Sampling through a tree whose drafts were drawn from known distributions, by recursive rejection sampling
    (SpecInfer's multi-step speculative sampling, Miao et al. 2024, Algorithm 2; SpecTr, Sun et al. 2023): at a node
    the residual r starts as the target's distribution after it; each child c in node order, drawn from q_c, is
    accepted with probability min(1, r(x_c) / q_c(x_c)) and the walk steps into it, else r becomes
    norm(max(r - q_c, 0)); when every child is rejected the committed token is drawn from r. The output is
    distributed exactly as plain sampling's for any q fixed before the target's draws. A deterministic draft (an
    n-gram copy, a top-k tree's node) is a one-hot q: it is accepted with r(x_c), which for a tree of such nodes
    alone is `sampled_tree_path`'s rule. target_probs (N, V): after each node; draft_probs (N, V): row i the
    distribution node i's token was drawn from (row 0, the root's, unused). Returns the path (root first) and the
    committed token after its last node (1,)."""
    children = tree.children
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        residual = target_probs[path[-1]]
        for child in sorted(children[path[-1]].values()):
            token, proposal = tokens[child], draft_probs[child]
            accept = (
                (residual[token] / proposal[token]).clamp(max=1.0) if proposal[token] > 0 else residual.new_zeros(())
            )
            if torch.rand((), generator=generator, device=residual.device) < accept:
                path.append(child)
                break
            residual = (residual - proposal).clamp(min=0)
            mass = residual.sum()
            residual = residual / mass if mass > 0 else target_probs[path[-1]]  # mass 0: a rejection of probability 0
        else:
            return path, torch.multinomial(residual, 1, generator=generator)


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
