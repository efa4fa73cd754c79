"""Drafter trees: the drafter's most probable continuations of its block as one tree (batch 1)."""

from __future__ import annotations

import torch

from ...policies.tree_size import TreeDrafting, remember_compiled_size
from ...rows import Rows
from ...stats import AcceptanceStats
from ..block_drafter import BlockDrafter, Drafts
from ..proposal import Proposal
from ..selector import sampling_temperature, selector_tree_children
from .chain import ChainDrafting


class DrafterTreeDrafting(ChainDrafting):
    """The block's drafter pass as for a chain, then a tree of the most probable continuations of its slots,
    sized by `trees` (`policies/tree_size.py`); a DFlash2 drafter's selector ranks each node's children given
    the node's token."""

    sends_trees = True

    def __init__(self, block: BlockDrafter, controller, do_sample: bool, logits_processor, trees: TreeDrafting):
        super().__init__(block, controller, do_sample, logits_processor)
        self.trees = trees

    def width(self) -> int:
        return self.trees.max_nodes

    def width_settled(self) -> bool:
        return not self.trees.choosing_size

    def proposal(self, hidden: torch.Tensor, rows: Rows, prefixes, bonus, block_length: int) -> Proposal:
        logits, token_ids = self.block.tree_logits(hidden, self.logits_processor, 1, rows.active, prefixes)
        choosing = self.trees.choosing_size
        drafter = self.block.drafter
        if drafter.candidate_selector is not None:  # DFlash2: each node's children ranked by the selector
            temperature = sampling_temperature(self.logits_processor) if self.do_sample else 1.0
            children = selector_tree_children(drafter, hidden[0], logits[0], token_ids, temperature)
            tree = self.trees.build_by(int(bonus[0]), hidden.shape[1], children)
        else:
            tree = self.trees.build(int(bonus[0]), logits[0], token_ids)
        if choosing:  # a one-size tree chose its size: later compiled calls keep it
            remember_compiled_size(self.block.drafter, self.trees)
        return Proposal(Drafts(tree.tokens[None, 1:]), tree, block_length, hidden.shape[1])

    def observe(self, rows: Rows, proposal: Proposal, verdict, committed, stats: AcceptanceStats) -> None:
        super().observe(rows, proposal, verdict, committed, stats)
        stats.tree_sizes.append(proposal.tree.num_nodes if proposal.tree is not None else 1)  # 1: no drafter pass
        if proposal.tree is not None:
            self.trees.observe(int(verdict.num_accepted[0]))

    def observe_block(self, accepted_drafts: int) -> None:
        self.trees.observe(accepted_drafts)
