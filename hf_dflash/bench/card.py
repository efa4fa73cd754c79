"""The model-card benchmark (`hf_dflash.hub_cards` schema) from a benchmark summary: DFlash vs plain."""

from __future__ import annotations

from ..hub_cards.schemas import validate_benchmark
from .summary import OVERALL

__all__ = ["benchmark_card"]


def divergence_note(divergences: list[dict], answers: int) -> str | None:
    """One sentence on the DFlash answers that differ from plain greedy (None when none does): how many,
    and the largest target top-2 logit gap at a first difference (a near-tie of a low-precision
    forward rounds either way; a large gap would be a bug)."""
    ours = [entry for entry in divergences if entry["method"] == "dflash"]
    if not ours:
        return None
    gaps = [entry["logit_gap"] for entry in ours if entry.get("logit_gap") is not None]
    where = f"; at each first difference the target's top-2 logit gap is <= {max(gaps):.4g}" if gaps else ""
    return f"{len(ours)} of {answers} DFlash answers differ from plain greedy{where}"


def benchmark_card(
    summary: dict, command: str, machine: str, settings: dict, divergences: list[dict] = ()
) -> dict | None:
    """`{"command", "machine", "settings", "sets": {name: {n, tau, speedup, plain_tok_s, dflash_tok_s,
    identical}}}` for our DFlash loop against plain decoding, validated; None unless both methods ran.

    An "overall" row is added when there are several sets. When sampling, outputs are not compared with
    plain greedy: `identical` is false and `settings["identity_check"]` says why. Greedy answers that
    differ are summarised in `settings["divergences"]` (`divergence_note`).
    """
    if not {"plain", "dflash"} <= set(summary[OVERALL]["methods"]):
        return None
    rows = dict(summary["sets"])
    if len(rows) > 1:
        rows[OVERALL] = summary[OVERALL]
    sets = {}
    for name, row in rows.items():
        # plain_tok_s is the baseline: the faster plain decoding (plain, or plain-alt in the other dtype)
        plain, dflash = row["methods"][row.get("baseline") or "plain"], row["methods"]["dflash"]
        sets[name] = {  # rounded to what the measurement supports (bench.json keeps every digit)
            "n": row["n"],
            "tau": round(dflash["tau"], 2) if dflash["tau"] is not None else 0.0,  # 0.0: no round ran
            "speedup": round(dflash["speedup"], 2),
            "plain_tok_s": round(plain["tok_s"], 1),
            "dflash_tok_s": round(dflash["tok_s"], 1),
            "identical": bool(dflash["identical"]),
        }
    note = divergence_note(list(divergences), summary[OVERALL].get("generations", 0))
    if note:
        settings = {**settings, "divergences": note}
    return validate_benchmark({"command": command, "machine": machine, "settings": settings, "sets": sets})
