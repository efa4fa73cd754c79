"""Hybrid drafting: a DFlash block and a prompt-lookup (n-gram) continuation verified as one draft tree.

With `prompt_lookup_num_tokens` beside a DFlash assistant (batch size 1), each round drafts the block (a chain
or a drafter tree: the wrapped strategy) and looks up an n-gram continuation of the committed tokens; the two
branches are merged into a trie (`draft_tree.merge_branches`: a shared prefix is verified once) and verified in ONE
target forward (greedy, or sampling by recursive rejection sampling: `verifying/tree_verification.py`), or
the better branch is chosen before verification (`one_branch`: a target that cannot take a tree mask). How
many drafts each branch offers is the `TreeBudget`'s choice (`policies/hybrid_budget.py`).
"""

from __future__ import annotations

import torch

from ...policies.hybrid_budget import tree_budget
from ...rows import Rows
from ...stats import AcceptanceStats
from ...verifying.acceptance_rules import accepted_lengths
from ..block_drafter import Drafts
from ..draft_tree import accepted_path, merge_branches, tree_depths
from ..ngram import DEFAULT_MAX_NGRAM_SIZE, PromptLookup
from ..proposal import Proposal
from .chain import ChainDrafting


class HybridDrafting:
    """The block of `inner` and the n-gram branch as one round (batch size 1).

    Each round: the n-gram continuation is looked up and the budget chooses (k, m); `inner` drafts the block
    (k > 1); both branches are merged into the round's proposal; after verification `observe` records the round
    and teaches the budget which branch was right. `fixed_width`: rounds verify one width (compiled)."""

    def __init__(self, inner: ChainDrafting, target, generation_config, one_branch: bool, fixed_width: bool):
        max_ngram_size = generation_config.max_matching_ngram_size
        self.prompt_lookup = PromptLookup(
            generation_config.prompt_lookup_num_tokens,
            DEFAULT_MAX_NGRAM_SIZE if max_ngram_size is None else max_ngram_size,
        )
        self.inner, self.block, self.one_branch = inner, inner.block, one_branch
        self.sends_trees = not one_branch or inner.sends_trees
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        drafter = inner.block.drafter
        self.fixed_width = fixed_width
        width = self.width() if fixed_width else None
        self.budget = tree_budget(drafter, target, self.prompt_lookup.num_tokens, one_branch, width)
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.ngram_found: torch.LongTensor | None = None  # the n-gram continuation found this round
        self.tree = None  # the round's draft as a tree (a chain unless both branches drafted)
        self.block_tree = None  # the block's part of it: its chain, or the drafter's tree

    def width(self) -> int:
        """The block's nodes + the n-gram drafts (one branch: whichever is longer)."""
        nodes, ngram = self.inner.width(), self.prompt_lookup.num_tokens
        return max(nodes, 1 + ngram) if self.one_branch else nodes + ngram

    def width_settled(self) -> bool:
        return self.inner.width_settled()

    def takes_plain_steps(self) -> bool:
        return self.budget.block is None  # the adaptive budget: a round without an n-gram may skip the block

    def propose(self, rows: Rows, prefill: bool) -> Proposal:
        prefixes = rows.prefixes()
        sequence = prefixes[0]
        self.ngram_found, match_length = self.prompt_lookup.draft(sequence, self.max_length - len(sequence) - 1)
        block_length, num_ngram = self.budget.choose(len(self.ngram_found), not prefill, match_length)
        ngram = self.ngram_found[:num_ngram]
        settled = self.inner.width_settled()
        block = self.inner.draft_block(rows, block_length, prefixes)
        if self.fixed_width and not settled and self.inner.width_settled():
            self.budget.verify_at(self.width())  # a one-size drafter tree chose its size: the round width follows
        if prefill and not len(ngram):
            return block
        drafts = self.candidates(int(sequence[-1]), block, ngram)
        return Proposal(drafts, None if self.tree.is_chain else self.tree, block_length, block.slots)

    def candidates(self, root: int, block: Proposal, ngram: torch.LongTensor) -> Drafts:
        """The round's draft from the block's proposal and the n-gram drafts (m,): the block alone, the n-gram
        chain alone (with one-hot draft probabilities when sampling: rejection sampling then accepts a draft with
        probability p(draft)), or both as `self.tree`'s nodes 1..N-1 (when sampling, with the distribution each node
        was drawn from: the chain's own, one-hot for the n-gram's and a drafter tree's deterministic nodes). A drafter
        tree (the block's tree) gets the n-gram chain grafted onto it."""
        self.block_tree = block.tree if block.tree is not None else merge_branches(root, [block.drafts.tokens[0]])
        self.tree = merge_branches(root, [ngram], base=self.block_tree)
        if not len(ngram):
            return block.drafts
        if not block.num_drafts:
            one_hot = torch.nn.functional.one_hot(ngram, self.vocab_size).float()[None] if self.do_sample else None
            return Drafts(ngram[None], one_hot)
        if not self.do_sample:
            return Drafts(self.tree.tokens[None, 1:])
        scores = torch.nn.functional.one_hot(self.tree.tokens[1:], self.vocab_size).float()  # (N-1, V)
        if block.tree is None:  # the chain's drafts were drawn from the block's distributions
            chain_nodes = torch.tensor(self.block_tree.branches[0], device=scores.device)
            scores[chain_nodes - 1] = block.drafts.scores[0].to(scores.dtype)
        return Drafts(self.tree.tokens[None, 1:], scores[None])

    def observe(self, rows: Rows, proposal: Proposal, verdict, committed, stats: AcceptanceStats) -> None:
        start = rows.lengths[0] - int(committed[0])
        tokens = rows.sequences[0, start : rows.lengths[0]]  # the round's accepted drafts, then its last token
        num_matches = len(tokens) - 1
        stats.tree_sizes.append(self.tree.num_nodes)
        stats.block_tokens.append(len(accepted_path(self.block_tree, tokens[:num_matches])) - 1)
        stats.ngram_tokens.append(agreement(self.tree.tokens[list(self.tree.branches[-1])], tokens[:num_matches]))
        # Each branch's drafts against the committed tokens, bonus included: for the n-gram branch also
        # the drafts found but left out of the tree (whether the target would have accepted them).
        block_depth = int(tree_depths(self.block_tree.parents).max())
        block_compared, ngram_compared = min(block_depth, len(tokens)), min(len(self.ngram_found), len(tokens))
        block_agreed = len(accepted_path(self.block_tree, tokens)) - 1
        self.budget.observe(block_compared, block_agreed, ngram_compared, agreement(self.ngram_found, tokens))
        if proposal.slots:  # a drafter tree is calibrated by the drafts the block won
            self.inner.observe_block(stats.block_tokens[-1])


def agreement(drafts: torch.LongTensor, committed: torch.LongTensor) -> int:
    """Length of the common prefix of drafts (d,) and committed (c,): the drafts the target accepted."""
    length = min(len(drafts), len(committed))
    return int(accepted_lengths(drafts[None, :length], committed[None, :length])[0])
