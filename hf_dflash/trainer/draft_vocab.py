"""Choosing a pruned draft vocabulary from the training replies (frequency-ranked, as EAGLE-3 / FR-Spec).

The drafter only ever has to propose tokens the target generates, so the subset is the N most frequent
supervised tokens (loss_mask == 1) of the training data. Coverage = the share of supervised tokens
inside the subset; a label outside it can never be drafted (it costs acceptance, never correctness).

    >>> counts = supervised_token_counts(train_samples, vocab_size=49152)
    >>> ids = select_draft_vocab(counts, 8192, always=[eos_id])
    >>> draft_vocab_report(counts, ids)
    {'draft_vocab_size': 8192, 'coverage': 0.9968, 'tokens': 1109237, 'size_for_coverage': {'0.95': 2716, ...}}
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["draft_vocab_report", "select_draft_vocab", "size_for_coverage", "supervised_token_counts"]

REPORTED_COVERAGES = (0.9, 0.95, 0.99, 0.999)


def supervised_token_counts(samples: Iterable[dict], vocab_size: int) -> torch.LongTensor:
    """(V,) how often each token id is a supervised token (loss_mask 1) in `samples` ({"input_ids", "loss_mask"})."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sample in samples:
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(sample["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def ranked(counts: torch.LongTensor) -> torch.LongTensor:
    """Token ids by descending count (ties: lower id first)."""
    return torch.sort(counts, descending=True, stable=True).indices


def size_for_coverage(counts: torch.LongTensor, coverage: float) -> int:
    """The smallest draft vocabulary size whose most frequent ids cover `coverage` of the supervised tokens."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}.")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("No supervised tokens to count: the data has no loss_mask == 1 positions.")
    cumulative = counts[ranked(counts)].cumsum(0)
    return int(torch.searchsorted(cumulative, torch.tensor(coverage * total, dtype=cumulative.dtype).ceil())) + 1


def select_draft_vocab(counts: torch.LongTensor, size: int, always: Sequence[int] = ()) -> torch.LongTensor:
    """(size,) ascending ids: the `size` most frequent supervised tokens, with the `always` ids (e.g. EOS)
    forced in (they displace the least frequent ones).

    Raises:
        ValueError: `size` outside [len(always), vocab_size], or an `always` id outside the vocabulary.
    """
    vocab = len(counts)
    always = sorted(set(int(i) for i in always))
    if not isinstance(size, int) or not max(len(always), 1) <= size <= vocab:
        raise ValueError(f"draft_vocab_size={size!r} must be an int in [{max(len(always), 1)}, vocab_size={vocab}].")
    if any(not 0 <= i < vocab for i in always):
        raise ValueError(f"Token ids {always} to keep in the draft vocabulary must lie in [0, {vocab}).")
    forced = torch.tensor(always, dtype=torch.long)
    rest = ranked(counts)
    rest = rest[~torch.isin(rest, forced)][: size - len(always)]
    return torch.cat([forced, rest]).sort().values


def draft_vocab_report(counts: torch.LongTensor, ids: torch.LongTensor) -> dict:
    """What the training record says about a draft vocabulary: its size, the coverage of the supervised
    tokens it reaches, and the sizes that would reach the usual coverages."""
    total = int(counts.sum())
    return {
        "draft_vocab_size": len(ids),
        "coverage": round(float(counts[ids].sum()) / max(total, 1), 4),
        "supervised_tokens": total,
        "size_for_coverage": {str(c): size_for_coverage(counts, c) for c in REPORTED_COVERAGES} if total else {},
    }
