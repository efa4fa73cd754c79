"""What a drafting strategy is: the source of each round's drafts, behind one interface the loop calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ...stats import AcceptanceStats
from ..block_drafter import BlockDrafter
from ..proposal import Proposal

if TYPE_CHECKING:
    from ...rows import Rows
    from ...verifying.verdict import Verdict


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

    def takes_plain_steps(self) -> bool:
        """Whether a round may verify the bonus token alone (a plain decoding step, chosen where drafting does
        not pay): compiled verification then runs such rounds through their own width-1 graph."""

    def propose(self, rows: Rows, prefill: bool) -> Proposal:
        """The round's drafts for the active rows. The prefill drafts no block (the drafter needs the prompt's
        features first)."""

    def observe(
        self, rows: Rows, proposal: Proposal, verdict: Verdict, committed: torch.LongTensor, stats: AcceptanceStats
    ) -> None:
        """The round's outcome: `committed` (R,) tokens per active row (already written to `rows`)."""
