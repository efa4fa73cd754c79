"""The benchmark report: one JSON document, the model-card benchmark beside it, and a printed table.

`bench.json`:

    {"command": "hf-dflash bench ...", "machine": "...", "settings": {...}, "methods": ["plain", ...],
     "sets": {name: {"n": prompts, "generations": answers per method (MT-Bench: 2 per prompt),
                     "baseline": the fastest settled plain method ("plain", "plain-alt" in the other dtype,
                                 the packed and compiled ones),
                     "unsettled": {method: why it is flagged: graphs compiled while timed},
                     "methods": {method: {"new_tokens", "seconds", "tok_s", "speedup" (vs the baseline),
                                          "tau", "rounds", "histogram" (histogram[t-1] = rounds committing t),
                                          "mean_block" (our loop: mean block length k the policy chose),
                                          "identical" (vs plain greedy; null when not checked),
                                          "divergences" (answers that differ),
                                          "branch_shares" (hybrid: {"block", "ngram", "shared", "bonus"}
                                                           shares of the rounds' committed tokens),
                                          "round_costs" (hybrid: {"rounds", "mean_tree_size", "mean_target_ms",
                                                         "by_tree_size": {nodes: {"rounds", "mean_target_ms"}}}),
                                          "compiles" (compiled methods: graphs compiled while timed; 0 once
                                                      the warm-up settled; null for eager methods)}}}},
     "overall": {same as one set, over all of them},
     "divergences": [{"set", "prompt_id", "turn", "method", "position", "logit_gap", "reference_token",
                      "other_token"}],
     "samples": [{"set", "prompt_id", "turn", "method", "prompt_tokens", "new_tokens", "seconds",
                  "acceptance_lengths", "identical", "divergence", "branches", "round_costs", "compiles"}],
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
from .methods import COMPILED_METHODS, HYBRID_METHODS
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
                    + (" (baseline)" if method == row.get("baseline") else "")
                    + (" (UNSETTLED)" if method in (row.get("unsettled") or {}) else ""),
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
            "dtypes: "
            + ", ".join(f"{method} {dtype}" for method, dtype in dtypes.items())
            + "; speed-ups are against the faster plain decoding of each set (marked baseline)"
        )
    warmups = report["settings"].get("warmup_seconds") or {}
    for method in COMPILED_METHODS:
        if method in warmups:
            text.append(f"{method}: compiled in its warm-up call ({warmups[method]:.1f} s, not in tok/s)")
    for method, reason in (report[OVERALL].get("unsettled") or {}).items():
        text.append(f"{method} (UNSETTLED): {reason}; flagged, never the baseline")
    if report["settings"].get("prompts_run"):
        text.append("prompts run: " + prompts_run_line(report["settings"]["prompts_run"]))
    for method in HYBRID_METHODS:
        if method in report["methods"]:
            text += ["", format_hybrid_table(report, method)]
    for divergence in report["divergences"]:
        text.append(
            f"divergence: {divergence['set']} {divergence['prompt_id']} turn {divergence['turn']} "
            f"{divergence['method']}: first difference at new token {divergence['position']}, "
            f"target top-2 logit gap {divergence['logit_gap']:.4f}"
        )
    return "\n".join(text)


TREE_SIZE_BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 12), (13, 16), (17, 20), (21, 24), (25, 32), (33, 10**6))


def _columns(lines: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * width for width in widths))
    return text


HYBRID_RIVALS = {  # what each must beat
    "hybrid": ("dflash", "lookup"),
    "hybrid-tree": ("tree", "hybrid"),
    "hybrid-compiled": ("dflash-compiled", "hybrid"),
    "hybrid-tree-compiled": ("tree-compiled", "hybrid-compiled"),
}


def format_hybrid_table(report: dict, method: str = "hybrid") -> str:
    """A hybrid method per set: where its committed tokens came from, its tree and forward cost per round,
    and its speed-up against the best of its rivals (hybrid: DFlash and prompt lookup; hybrid-tree: the
    drafter's tree and hybrid); then target forward time by tree size."""
    header = ("set", "τ", "block", "n-gram", "both", "bonus", "nodes/round", "forward ms", "speedup",
              "best other", "ratio")  # fmt: skip
    lines = [header]
    for name, row in {**report["sets"], OVERALL: report[OVERALL]}.items():
        stats = row["methods"][method]
        shares, costs = stats["branch_shares"] or {}, stats["round_costs"]
        others = [(row["methods"][m]["speedup"], m) for m in HYBRID_RIVALS[method] if m in row["methods"]]
        others = [(value, m) for value, m in others if value is not None]
        best = max(others) if others else None
        lines.append(
            (
                name,
                _number(stats["tau"], ".2f"),
                *(_number(shares.get(key), ".0%") for key in ("block", "ngram", "shared", "bonus")),
                _number(costs["mean_tree_size"], ".1f"),
                _number(costs["mean_target_ms"], ".1f"),
                _number(stats["speedup"], ".2f") + ("x" if stats["speedup"] is not None else ""),
                f"{best[0]:.2f}x {best[1]}" if best else "-",
                f"{stats['speedup'] / best[0]:.2f}" if best and stats["speedup"] else "-",
            )
        )
    text = [
        f"{method}: committed tokens by origin, cost per round, and against the better of "
        + "/".join(HYBRID_RIVALS[method]),
        *_columns(lines),
    ]
    by_size = report[OVERALL]["methods"][method]["round_costs"]["by_tree_size"]
    buckets = [("tree nodes", "rounds", "target forward ms")]
    for low, high in TREE_SIZE_BUCKETS:
        inside = [value for size, value in by_size.items() if low <= int(size) <= high]
        rounds = sum(value["rounds"] for value in inside)
        if rounds:
            milliseconds = sum(value["rounds"] * value["mean_target_ms"] for value in inside) / rounds
            label = str(low) if low == high else f"{low}-{high}" if high < 10**6 else f">= {low}"
            buckets.append((label, str(rounds), f"{milliseconds:.1f}"))
    if len(buckets) > 1:
        text += ["", f"{method} rounds by tree size (overall)", *_columns(buckets)]
    return "\n".join(text)
