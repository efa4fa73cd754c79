"""Held-out τ of a drafter on chats training did not see: the figure that decides, before the (slow) bench,
whether a drafter is worth serving (`benchmarks/training/heldout_tau.py` compares several; the recipe's
`heldout` stage scores the one it trained).

    samples = held_out_samples("data/smollm2-135m-instruct", 64, eval_part="regen-bf16-part2")
    row = heldout_tau_row(drafter, target, samples)   # {"served_tau", "all_anchor_tau", "rounds", "seconds"}
"""

from __future__ import annotations

import time
from pathlib import Path

from ..data.packed import PackedDataset, source_of
from .consistency import served_tau_estimate
from .train import held_out_indices

__all__ = ["held_out_samples", "heldout_tau_row", "served_tau_by_source"]


def held_out_samples(
    packed: str | Path, count: int, eval_part: str | None = None, parts: list[str] | None = None
) -> list[dict]:
    """The held-out chats of a packed folder (only its `parts` when given): the first `count` of part `eval_part`,
    else the last `count` (the samples `hf-dflash train` holds out with `data.eval_samples: count`; with `parts`,
    a set that was the data's last before more parts were appended)."""
    dataset = PackedDataset(packed, parts=parts)
    return [dataset[i] for i in held_out_indices(dataset, count, eval_part, parts)]


def heldout_tau_row(drafter, target, samples: list[dict], max_reply_tokens: int | None = None) -> dict:
    """Served-walk τ (anchors visited as `generate` visits them) and uniform all-anchor τ of `drafter` on
    `samples` (each reply whole, or its first `max_reply_tokens`), with the number of served rounds and the
    seconds it took."""
    start = time.perf_counter()
    estimate = served_tau_estimate(drafter, target, samples, max_reply_tokens=max_reply_tokens)
    return {
        "served_tau": round(estimate.served_tau, 4),
        "all_anchor_tau": round(estimate.uniform_tau, 4),
        "rounds": len(estimate.rounds),
        "samples": len(samples),
        "seconds": round(time.perf_counter() - start, 1),
        "by_source": served_tau_by_source(samples, estimate),
    }


def served_tau_by_source(samples: list[dict], estimate) -> dict[str, dict]:
    """{source: {"served_tau", "samples", "rounds"}}: the served-walk τ over the samples of each data source
    (the id's prefix, "gsm8k:12" -> "gsm8k"), committed tokens over rounds as for the whole set."""
    totals: dict[str, list] = {}
    for sample, tau, rounds in zip(samples, estimate.per_sample, estimate.per_sample_rounds):
        total = totals.setdefault(source_of(str(sample.get("id", "unknown"))), [0.0, 0, 0])
        total[0] += tau * rounds
        total[1] += 1
        total[2] += rounds
    return {
        source: {"served_tau": round(tokens / max(rounds, 1), 4), "samples": count, "rounds": rounds}
        for source, (tokens, count, rounds) in sorted(totals.items())
    }
