"""Where a speculative output first leaves the reference output, and how close the target's call was there.

In fp32 every greedy speculative output equals plain greedy. In bf16 a k-token verification forward
rounds differently from a 1-token decode step, so a near-tie between the target's top two tokens may
flip: a tiny top-2 logit gap at the first difference is such a near-tie, a large one would be a bug.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["Divergence", "divergence_note", "first_divergence"]


@dataclass(frozen=True)
class Divergence:
    """The first position where two outputs of the same prompt differ."""

    position: int  # index among the new tokens (0 = the first generated token)
    logit_gap: float  # target's top-1 minus top-2 logit there, from one forward over the shared prefix
    reference_token: int | None  # the reference's token there (None: the reference ended)
    other_token: int | None  # the other output's token there (None: it ended)

    def note(self) -> str:
        return f"first difference at new token {self.position}, target top-2 logit gap {self.logit_gap:.4f}"

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def first_divergence(
    target, reference: torch.LongTensor, other: torch.LongTensor, prompt_length: int
) -> Divergence | None:
    """The first difference of `other` from `reference` (both (1, prompt_length + new)), or None when equal."""
    if torch.equal(reference, other):
        return None
    length = min(reference.shape[1], other.shape[1])
    differs = (reference[0, :length] != other[0, :length]).nonzero()
    position = int(differs[0, 0]) if len(differs) else length  # else: one output is a prefix of the other
    top2 = target(reference[:, :position]).logits[0, -1].float().topk(2).values
    return Divergence(
        position=position - prompt_length,
        logit_gap=float(top2[0] - top2[1]),
        reference_token=int(reference[0, position]) if position < reference.shape[1] else None,
        other_token=int(other[0, position]) if position < other.shape[1] else None,
    )


def divergence_note(target, plain: torch.LongTensor, other: torch.LongTensor, prompt_length: int) -> str:
    """Human-readable `first_divergence` of `other` from plain greedy ("identical" when equal)."""
    divergence = first_divergence(target, plain, other, prompt_length)
    return "identical" if divergence is None else divergence.note()
