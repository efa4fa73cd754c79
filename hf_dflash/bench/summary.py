"""Per-set and overall numbers of each method, from the benchmark's samples.

Rates are totals, not means of per-prompt rates: tokens/s = all new tokens / all seconds, so long
answers weigh as much as they cost. τ is the mean over all verification rounds of the set.
Hybrid drafting also gets `branch_shares` (the committed tokens of its rounds by origin) and `round_costs`
(tree nodes and target forward time per round, overall and per tree size); both are None for the others.
A compiled method reports `compiles`, the graphs compiled while its calls were timed (None for eager ones): a
plain method that compiled there (its warm-up did not settle) is no candidate for the baseline, and
`unsettled` names it with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from .methods import HYBRID_METHODS, PLAIN_METHODS, TREE_METHODS, max_round_length
from .runner import Sample

__all__ = ["OVERALL", "histogram", "summarize", "summarize_samples"]

OVERALL = "overall"


def histogram(lengths: list[int], size: int) -> list[int]:
    """counts[t - 1] = rounds that committed t tokens, for t = 1..max(size, longest round)."""
    counts = [0] * max([size, *lengths])
    for length in lengths:
        counts[length - 1] += 1
    return counts


def summarize_method(samples: list[Sample], method: str, block_size: int, plain_tok_s: float | None) -> dict:
    mine = [sample for sample in samples if sample.method == method]
    new_tokens = sum(sample.new_tokens for sample in mine)
    seconds = sum(sample.seconds for sample in mine)
    tok_s = new_tokens / seconds if seconds > 0 else 0.0
    checked = [sample.identical for sample in mine if sample.identical is not None]
    summary = {
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tok_s": tok_s,
        "speedup": tok_s / plain_tok_s if plain_tok_s else None,
        "tau": None,
        "rounds": None,
        "histogram": None,
        "mean_block": None,
        "identical": all(checked) if checked else None,
        "divergences": checked.count(False),
        "branch_shares": None,
        "round_costs": None,
        "compiles": None,
    }
    compiles = [sample.compiles for sample in mine if sample.compiles is not None]
    if compiles:
        summary["compiles"] = sum(compiles)
    blocks = [k for sample in mine for k in (sample.block_sizes or [])]
    if blocks:
        summary["mean_block"] = sum(blocks) / len(blocks)  # the block length the policy chose, on average
    if method not in PLAIN_METHODS:
        lengths = [length for sample in mine for length in sample.acceptance_lengths]
        summary |= {
            "tau": sum(lengths) / len(lengths) if lengths else None,
            "rounds": len(lengths),
            "histogram": histogram(lengths, max_round_length(method, block_size)),
        }
    if method in HYBRID_METHODS:
        summary |= {"branch_shares": branch_shares(mine)}
    if method in (*HYBRID_METHODS, *TREE_METHODS):
        summary |= {"round_costs": round_costs(mine)}
    return summary


def branch_shares(samples: list[Sample]) -> dict[str, float] | None:
    """{"block", "ngram", "shared", "bonus"}: shares of the tokens committed by verification rounds that
    were drafted by the DFlash block only, the n-gram branch only, both, or were the target's bonus token."""
    totals = {key: sum(sample.branches[key] for sample in samples) for key in ("block", "ngram", "shared", "bonus")}
    committed = sum(totals.values())
    return {key: value / committed for key, value in totals.items()} if committed else None


def round_costs(samples: list[Sample]) -> dict:
    """Per round: mean tree nodes and target forward milliseconds, overall and per tree size."""
    rounds = [cost for sample in samples for cost in sample.round_costs]
    by_size: dict[int, list[float]] = {}
    for size, seconds in rounds:
        by_size.setdefault(int(size), []).append(seconds)
    return {
        "rounds": len(rounds),
        "mean_tree_size": sum(size for size, _ in rounds) / len(rounds) if rounds else None,
        "mean_target_ms": 1000 * sum(seconds for _, seconds in rounds) / len(rounds) if rounds else None,
        "by_tree_size": {
            str(size): {"rounds": len(times), "mean_target_ms": 1000 * sum(times) / len(times)}
            for size, times in sorted(by_size.items())
        },
    }


def unsettled_reason(summary: dict) -> str | None:
    """Why a method's `summarize_method` summary is no valid row, or None: graphs compiled while timed."""
    if summary["compiles"]:
        return (
            f"compiled {summary['compiles']} graph(s) while timed: its warm-up did not settle, so its seconds hold "
            "compiles (or eager steps past dynamo's recompile limit)"
        )
    return None


def summarize_samples(samples: list[Sample], methods: Sequence[str], block_size: int) -> dict:
    """`{"n": prompts, "generations": answers per method, "baseline": method, "unsettled": {method: reason},
    "methods": {method: {...}}}` for `samples`. Speed-ups are against the baseline: the faster of the plain
    methods that ran ("plain", "plain-alt" in the other dtype, the packed and compiled ones), so a slow dtype never
    inflates them; a method that compiled while timed (`unsettled_reason`) is flagged and never the baseline."""
    alone = {method: summarize_method(samples, method, block_size, None) for method in methods}
    unsettled = {method: reason for method in methods if (reason := unsettled_reason(alone[method])) is not None}
    plain_rates = {method: alone[method]["tok_s"] for method in methods if method in PLAIN_METHODS}
    plain_rates = {method: rate for method, rate in plain_rates.items() if method not in unsettled}
    baseline = max(plain_rates, key=plain_rates.get) if plain_rates else None
    baseline_tok_s = plain_rates.get(baseline)
    return {
        "n": len({(sample.set, sample.prompt_id) for sample in samples}),
        "generations": sum(sample.method == methods[0] for sample in samples),
        "baseline": baseline,
        "unsettled": unsettled,
        "methods": {method: summarize_method(samples, method, block_size, baseline_tok_s) for method in methods},
    }


def summarize(samples: list[Sample], methods: Sequence[str], block_size: int) -> dict:
    """`{"sets": {set name: summary}, "overall": summary}` (see `summarize_samples`)."""
    names = list(dict.fromkeys(sample.set for sample in samples))
    return {
        "sets": {
            name: summarize_samples([sample for sample in samples if sample.set == name], methods, block_size)
            for name in names
        },
        OVERALL: summarize_samples(samples, methods, block_size),
    }
