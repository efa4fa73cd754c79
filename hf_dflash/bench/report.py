"""The benchmark report: one JSON document, the model-card benchmark beside it, and a printed table.

`bench.json`:

    {"command": "hf-dflash bench ...", "machine": "...", "settings": {...}, "methods": ["plain", ...],
     "sets": {name: {"n": prompts, "generations": answers per method (MT-Bench: 2 per prompt),
                     "baseline": the faster plain method ("plain" or "plain-alt", the other dtype),
                     "methods": {method: {"new_tokens", "seconds", "tok_s", "speedup" (vs the baseline),
                                          "tau", "rounds", "histogram" (histogram[t-1] = rounds committing t),
                                          "mean_block" (our loop: mean block length k the policy chose),
                                          "identical" (vs plain greedy; null when not checked),
                                          "divergences" (answers that differ)}}}},
     "overall": {same as one set, over all of them},
     "divergences": [{"set", "prompt_id", "turn", "method", "position", "logit_gap", "reference_token",
                      "other_token"}],
     "samples": [{"set", "prompt_id", "turn", "method", "prompt_tokens", "new_tokens", "seconds",
                  "acceptance_lengths", "identical", "divergence"}],
     "plots": ["acceptance_gsm8k.png", ...],
     "card": {"command", "machine", "settings", "sets": {name: {"n", "tau", "speedup", "plain_tok_s",
              "dflash_tok_s", "identical"}}} or null}   # hf_dflash.hub_cards schema, DFlash vs plain

`benchmark.json` holds the `card` object alone: `hf-dflash export --benchmark OUT/benchmark.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..hub_cards.schemas import BENCHMARK_NAME
from .card import benchmark_card
from .runner import Sample
from .summary import OVERALL

__all__ = ["REPORT_NAME", "build_report", "format_table", "prompts_run_line", "write_report"]

REPORT_NAME = "bench.json"


def build_report(summary: dict, samples: list[Sample], command: str, machine: str, settings: dict) -> dict:
    """The `bench.json` document (see the module docstring), without `plots`."""
    divergences = [
        {"set": s.set, "prompt_id": s.prompt_id, "turn": s.turn, "method": s.method, **s.divergence.to_dict()}
        for s in samples
        if s.divergence is not None
    ]
    return {
        "command": command,
        "machine": machine,
        "settings": settings,
        "methods": list(summary[OVERALL]["methods"]),
        "sets": summary["sets"],
        OVERALL: summary[OVERALL],
        "divergences": divergences,
        "samples": [asdict(sample) for sample in samples],
        "card": benchmark_card(summary, command, machine, settings, divergences),
    }


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    """Write `bench.json` (and `benchmark.json`, the card, when there is one) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    documents = {REPORT_NAME: report}
    if report["card"] is not None:
        documents[BENCHMARK_NAME] = report["card"]
    for name, document in documents.items():
        (out / name).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [out / name for name in documents]


def prompts_run_line(prompts_run: dict) -> str:
    """E.g. "gsm8k: 8 of 1319 prompts, mine: 20 of 20 prompts" from settings["prompts_run"]."""
    return ", ".join(f"{name}: {run} of {total} prompts" for name, (run, total) in prompts_run.items())


def _number(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def _identical(stats: dict, method: str) -> str:
    if method == "plain":
        return "reference"
    if method == "plain-alt":
        return "not compared (other dtype)"
    if stats["identical"] is None:
        return "not checked"
    return "yes" if stats["identical"] else f"NO ({stats['divergences']} differ)"


def _histogram(counts: list[int] | None) -> str:
    return " ".join(f"{t}:{count}" for t, count in enumerate(counts or [], 1) if count) or "-"


def format_table(report: dict) -> str:
    """A plain-text table: one line per set and method, then every divergence."""
    header = ("set", "method", "n", "τ", "mean k", "tok/s", "speedup", "identical", "rounds by length (t:count)")
    lines = [header]
    for name, row in {**report["sets"], OVERALL: report[OVERALL]}.items():
        for position, (method, stats) in enumerate(row["methods"].items()):
            lines.append(
                (
                    name if position == 0 else "",
                    method,
                    str(row["n"]) if position == 0 else "",
                    _number(stats["tau"], ".2f"),
                    _number(stats.get("mean_block"), ".1f"),
                    _number(stats["tok_s"], ".1f"),
                    _number(stats["speedup"], ".2f")
                    + ("x" if stats["speedup"] is not None else "")
                    + (" (baseline)" if method == row.get("baseline") else ""),
                    _identical(stats, method),
                    _histogram(stats["histogram"]),
                )
            )
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * width for width in widths))
    dtypes = report["settings"].get("dtypes") or {}
    if dtypes:
        text.append(
            "dtypes: " + ", ".join(f"{method} {dtype}" for method, dtype in dtypes.items())
            + "; speed-ups are against the faster plain decoding of each set (marked baseline)"
        )
    if report["settings"].get("prompts_run"):
        text.append("prompts run: " + prompts_run_line(report["settings"]["prompts_run"]))
    for divergence in report["divergences"]:
        text.append(
            f"divergence: {divergence['set']} {divergence['prompt_id']} turn {divergence['turn']} "
            f"{divergence['method']}: first difference at new token {divergence['position']}, "
            f"target top-2 logit gap {divergence['logit_gap']:.4f}"
        )
    return "\n".join(text)
