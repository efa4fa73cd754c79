"""The model-card benchmark (`hf_dflash.hub_cards` schema) from a benchmark summary: DFlash vs plain."""

from __future__ import annotations

from ..hub_cards.schemas import validate_benchmark
from .summary import OVERALL

__all__ = ["benchmark_card"]


def benchmark_card(summary: dict, command: str, machine: str, settings: dict) -> dict | None:
    """`{"command", "machine", "settings", "sets": {name: {n, tau, speedup, plain_tok_s, dflash_tok_s,
    identical}}}` for our DFlash loop against plain decoding, validated; None unless both methods ran.

    An "overall" row is added when there are several sets. When sampling, outputs are not compared with
    plain greedy: `identical` is false and `settings["identity_check"]` says why.
    """
    if not {"plain", "dflash"} <= set(summary[OVERALL]["methods"]):
        return None
    rows = dict(summary["sets"])
    if len(rows) > 1:
        rows[OVERALL] = summary[OVERALL]
    sets = {}
    for name, row in rows.items():
        plain, dflash = row["methods"]["plain"], row["methods"]["dflash"]
        sets[name] = {
            "n": row["n"],
            "tau": dflash["tau"] if dflash["tau"] is not None else 0.0,  # 0.0: no round ran (as AcceptanceStats)
            "speedup": dflash["speedup"],
            "plain_tok_s": plain["tok_s"],
            "dflash_tok_s": dflash["tok_s"],
            "identical": bool(dflash["identical"]),
        }
    return validate_benchmark({"command": command, "machine": machine, "settings": settings, "sets": sets})
