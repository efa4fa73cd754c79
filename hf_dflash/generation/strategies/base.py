"""What a drafting strategy is: the source of each round's drafts, behind one interface the loop calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..drafting import BlockDrafter, Drafts
from ..stats import AcceptanceStats
from ..tree import DraftTree

if TYPE_CHECKING:
    from ..rows import Rows
    from ..verdict import Verdict


@dataclass
class Proposal:
    """What a round verifies: drafts (R, d) after each row's bonus token, the tree they form (batch 1: a drafter
    tree, or the branches of hybrid drafting; None for chains), the block length k of the drafter pass and the
    block's draft slots it filled (0: no drafter pass)."""

    drafts: Drafts
    tree: DraftTree | None
    block_length: int
    slots: int

    @property
    def num_drafts(self) -> int:
        return self.drafts.tokens.shape[1]


class DraftStrategy(Protocol):
    """One `generate` call's source of drafts. Each round the loop asks `propose`, verifies the proposal in one
    target forward, commits what the target accepts and tells `observe`.

    sends_trees: rounds may verify a tree (compiled rounds then all go through the tree mask: one graph)."""

    sends_trees: bool
    block: BlockDrafter  # the drafter's pass and context, shared by the strategies a strategy wraps

    def width(self) -> int:
        """The most tokens a round after the prefill verifies (the bonus included): compiled rounds are padded
        to it."""

    def width_settled(self) -> bool:
        """False while the width may still change (a one-size tree before its first tree): rounds run eager."""

    def propose(self, rows: Rows, prefill: bool) -> Proposal:
        """The round's drafts for the active rows. The prefill drafts no block (the drafter needs the prompt's
        features first)."""

    def observe(
        self, rows: Rows, proposal: Proposal, verdict: Verdict, committed: torch.LongTensor, stats: AcceptanceStats
    ) -> None:
        """The round's outcome: `committed` (R,) tokens per active row (already written to `rows`)."""
