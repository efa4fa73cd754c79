"""PNG plots of a benchmark summary: the acceptance-length histogram of each set, speed-up per method."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from .summary import OVERALL

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["acceptance_figure", "speedup_figure", "write_plots"]


def acceptance_figure(name: str, row: dict) -> Figure | None:
    """Share of verification rounds committing t tokens, one bar group per t, one bar per speculative method
    (None when no method of the set ran a round)."""
    # imported here: matplotlib costs ~0.4 s, which every `hf-dflash` command would pay at start-up otherwise;
    # its object API needs no pyplot state and no GUI backend
    from matplotlib.figure import Figure

    methods = {method: stats for method, stats in row["methods"].items() if stats["rounds"]}
    if not methods:
        return None
    longest = max(len(stats["histogram"]) for stats in methods.values())
    width = 0.8 / len(methods)
    figure = Figure(figsize=(max(6.0, 0.45 * longest + 2), 3.6), layout="constrained")
    axes = figure.add_subplot()
    for offset, (method, stats) in enumerate(methods.items()):
        shares = [count / stats["rounds"] for count in stats["histogram"]]
        positions = [t + 1 + (offset - (len(methods) - 1) / 2) * width for t in range(len(shares))]
        axes.bar(positions, shares, width=width, label=f"{method} (τ = {stats['tau']:.2f})")
    axes.set_xticks(range(1, longest + 1))
    axes.set_xlabel("tokens committed per verification round (accepted drafts + bonus)")
    axes.set_ylabel("share of rounds")
    axes.set_title(f"Acceptance lengths: {name} (n = {row['n']})")
    axes.legend()
    return figure


def speedup_figure(summary: dict) -> Figure | None:
    """Speed-up over plain decoding per set (and overall), one bar per method (None without plain)."""
    from matplotlib.figure import Figure  # see acceptance_figure

    rows = {**summary["sets"], OVERALL: summary[OVERALL]}
    overall = summary[OVERALL]["methods"]
    methods = [method for method, stats in overall.items() if method != "plain" and stats["speedup"]]
    if not methods:
        return None
    width = 0.8 / len(methods)
    figure = Figure(figsize=(max(6.0, 1.2 * len(rows) + 2), 3.6), layout="constrained")
    axes = figure.add_subplot()
    for offset, method in enumerate(methods):
        positions = [index + (offset - (len(methods) - 1) / 2) * width for index in range(len(rows))]
        values = [row["methods"][method]["speedup"] for row in rows.values()]
        bars = axes.bar(positions, values, width=width, label=method)
        axes.bar_label(bars, fmt="%.2f", fontsize=7)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(rows)), list(rows))
    axes.set_ylabel("speed-up over plain decoding (tokens/s ratio)")
    axes.set_title("Speed-up per method")
    axes.legend()
    return figure


def slug(name: str) -> str:
    """A file-name-safe version of a set name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_plots(summary: dict, out_dir: str | Path) -> list[Path]:
    """Write `acceptance_<set>.png` (each set and overall) and `speedup.png` into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        f"acceptance_{slug(name)}.png": acceptance_figure(name, row)
        for name, row in {**summary["sets"], OVERALL: summary[OVERALL]}.items()
    }
    figures["speedup.png"] = speedup_figure(summary)
    written = []
    for file_name, figure in figures.items():
        if figure is not None:
            figure.savefig(out / file_name, dpi=120)
            written.append(out / file_name)
    return written
