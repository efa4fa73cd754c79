"""Chains: one drafter pass drafts `[bonus, MASK x (k - 1)]` for every row, k fixed or chosen each round; under
the "confidence" policy the round verifies the prefix of the drafts the drafter is confident enough in
(`policies/confidence.py`)."""

from __future__ import annotations

import torch

from ...policies.block_size import BlockSizeController, FixedBlockSize
from ...policies.confidence import PrefixController
from ...rows import Rows
from ...stats import AcceptanceStats
from ..block_drafter import BlockDrafter, Drafts
from ..proposal import Proposal


class ChainDrafting:
    """A block of k tokens drafts k - 1 tokens for every row, never past the longest row's limit; k from the
    `controller` (`policies/block_size.py`), or chosen by a strategy that wraps this one (hybrid drafting:
    controller None, the trained block B)."""

    sends_trees = False

    def __init__(self, block: BlockDrafter, controller: BlockSizeController | None, do_sample: bool, logits_processor):
        self.block, self.controller = block, controller
        self.do_sample, self.logits_processor = do_sample, logits_processor

    def width(self) -> int:
        if isinstance(self.controller, FixedBlockSize):
            return self.controller.block_size
        return self.block.drafter.config.block_size

    def width_settled(self) -> bool:
        return True

    def takes_plain_steps(self) -> bool:
        return not isinstance(self.controller, FixedBlockSize)  # adaptive, scheduled or confident lengths

    def propose(self, rows: Rows, prefill: bool) -> Proposal:
        block_length = 1 if prefill else self.controller.choose(rows.active)
        return self.draft_block(rows, block_length, rows.prefixes())

    def draft_block(self, rows: Rows, block_length: int, prefixes: list[torch.LongTensor]) -> Proposal:
        """The drafts of one drafter pass at block length k (none when k = 1 or no row has room)."""
        num_drafts = max(0, min(block_length - 1, rows.room()))
        bonus = rows.last_tokens()
        if not num_drafts:
            return Proposal(Drafts(bonus.new_empty(len(rows.active), 0)), None, block_length, 0)
        hidden = self.block.draft_hidden(bonus, block_length)[:, :num_drafts]
        return self.proposal(hidden, rows, prefixes, bonus, block_length)

    def proposal(self, hidden: torch.Tensor, rows: Rows, prefixes, bonus, block_length: int) -> Proposal:
        """The proposal from the drafter's outputs (R, d, H): argmax tokens, or samples when sampling (a DFlash2
        drafter: its selector's walk from each row's bonus token (R,))."""
        by_confidence = isinstance(self.controller, PrefixController)
        drafts = self.block.draft(
            hidden, self.do_sample, self.logits_processor, rows.batch_size, rows.active, prefixes, bonus, by_confidence
        )
        if by_confidence:  # the prefix worth verifying (none: a plain step)
            drafts = drafts.prefix(self.controller.prefix(drafts.probabilities))
        return Proposal(drafts, None, block_length, hidden.shape[1])

    def observe(self, rows: Rows, proposal: Proposal, verdict, committed, stats: AcceptanceStats) -> None:
        self.controller.observe(rows.active, proposal.num_drafts, verdict.num_accepted)

    def observe_block(self, accepted_drafts: int) -> None:
        """A wrapping strategy reports the drafts of this strategy's block the target accepted (a chain learns
        nothing from it: its controller is the wrapper's budget)."""
