"""What a drafting strategy proposes for one round: the drafts and the tree they form."""

from __future__ import annotations

from dataclasses import dataclass

from .block_drafter import Drafts
from .draft_tree import DraftTree


@dataclass
class Proposal:
    """What a round verifies: drafts (R, d) after each row's bonus token, the tree they form (batch 1: a drafter
    tree, or the branches of hybrid drafting; None for chains), the block length k of the drafter pass and the
    block's draft slots it filled (0: no drafter pass; more than d where only a prefix is verified)."""

    drafts: Drafts
    tree: DraftTree | None
    block_length: int
    slots: int

    @property
    def num_drafts(self) -> int:
        return self.drafts.tokens.shape[1]
