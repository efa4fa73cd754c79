"""How busy the machine is while `hf-dflash demo` and `bench` time generation, read from /proc (Linux; no
dependency), and the thread count chosen by a quick measurement when other processes share the cores.

With three other jobs on 2 cores the demo once printed plain 0.6 tok/s and DFlash 1.5 tok/s, 40x slower than on
the quiet machine, without a word: OpenMP's worker threads spin-wait for each other, and on cores that other
processes hold each barrier costs a scheduler time slice. Both commands now print (and bench records in its JSON)
the 1-minute load average against the usable cores and the other busy processes, warn when the timings cannot be
trusted, and say what helps.

    load = read_machine_load()                        # ~0.25 s: two /proc samples
    threads = choose_threads(load, time_forward)      # shared machine: the fastest of a few thread counts
    print(describe_load(load, threads))
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MachineLoad", "ThreadChoice", "choose_threads", "describe_load", "read_machine_load", "timing_threads"]

SAMPLE_SECONDS = 0.25
BUSY_PERCENT = 10.0  # another process using more than this share of one core over the sample is listed
SHARED_OTHER_CORES = 0.5  # other processes using half a core or more: timings are not to be trusted
ADVICE = (
    "what helps: a quiet machine, fewer threads (OMP_NUM_THREADS=1 or torch.set_num_threads), and "
    "OMP_WAIT_POLICY=PASSIVE set before the command starts (OpenMP's threads then sleep instead of spinning)"
)


@dataclass
class MachineLoad:
    """A reading of the machine: `load_average` (1 minute, counts this process too), `usable_cores` (this
    process's CPU affinity), `busy` [(name, pid, percent of one core)] of the other processes over the sample."""

    load_average: float | None
    usable_cores: int
    busy: list[tuple[str, int, float]] = field(default_factory=list)

    @property
    def other_cores(self) -> float:
        """Cores the other busy processes used during the sample."""
        return sum(percent for _, _, percent in self.busy) / 100

    @property
    def shared(self) -> bool:
        """Other processes compete for the cores: by the sample, or by a load average above the cores plus us."""
        crowded = self.load_average is not None and self.load_average >= self.usable_cores + 1
        return self.other_cores >= SHARED_OTHER_CORES or crowded

    def record(self) -> dict:
        return {
            "load_average_1m": self.load_average,
            "usable_cores": self.usable_cores,
            "other_busy_processes": [{"name": n, "pid": p, "cpu_percent": round(c, 1)} for n, p, c in self.busy],
            "other_busy_cores": round(self.other_cores, 2),
            "timings_trustworthy": not self.shared,
        }


def _cpu_ticks(proc: Path) -> dict[int, tuple[str, int]]:
    """{pid: (name, user + system clock ticks)} of every readable process."""
    ticks = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        ticks[int(entry.name)] = (name, int(rest[11]) + int(rest[12]))  # utime, stime (fields 14, 15)
    return ticks


def busy_processes(before: dict, after: dict, seconds: float, ticks_per_second: int, own: set[int]) -> list:
    """[(name, pid, percent of one core)] of the processes (not in `own`) that used > BUSY_PERCENT between the
    two `_cpu_ticks` readings, busiest first."""
    busy = []
    for pid, (name, ticks) in after.items():
        if pid in own or pid not in before:
            continue
        percent = 100 * (ticks - before[pid][1]) / ticks_per_second / seconds
        if percent > BUSY_PERCENT:
            busy.append((name, pid, percent))
    return sorted(busy, key=lambda row: -row[2])


def read_machine_load(proc: str | os.PathLike = "/proc", seconds: float = SAMPLE_SECONDS) -> MachineLoad:
    """The machine's load now: two readings of /proc `seconds` apart (this process and its threads excluded).
    Where /proc is missing (not Linux) only the load average and the cores are read."""
    proc = Path(proc)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load_average = float((proc / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if not proc.is_dir():
        return MachineLoad(load_average, cores)
    before, start = _cpu_ticks(proc), time.monotonic()
    time.sleep(seconds)
    after, elapsed = _cpu_ticks(proc), time.monotonic() - start
    busy = busy_processes(before, after, elapsed, os.sysconf("SC_CLK_TCK"), {os.getpid()})
    return MachineLoad(load_average, cores, busy)


@dataclass
class ThreadChoice:
    """The thread count used for the timings, and why (`seconds`: the measured time per thread count)."""

    threads: int
    reason: str
    seconds: dict[int, float] = field(default_factory=dict)

    def record(self) -> dict:
        return {"threads": self.threads, "reason": self.reason, "seconds": {str(k): v for k, v in self.seconds.items()}}


def choose_threads(
    load: MachineLoad,
    run_once: Callable[[], None],
    current: int,
    set_threads: Callable[[int], None],
    environ: dict | None = None,
    repeats: int = 3,
) -> ThreadChoice:
    """On a shared machine, the fastest of a few thread counts for `run_once` (one short target forward: best of
    `repeats` after a warm-up; a count already twice as slow as the best is dropped after one call), set with
    `set_threads`; elsewhere, or when OMP_NUM_THREADS is set, `current`."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return ThreadChoice(current, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} is set: kept")
    if not load.shared:
        return ThreadChoice(current, "a quiet machine: the default")
    free = max(1, round(load.usable_cores - load.other_cores))
    seconds: dict[int, float] = {}
    for threads in sorted({1, free, current}):
        set_threads(threads)
        timings = []
        for _ in range(repeats + 1):  # the first call warms up; counted only while it is all there is
            start = time.perf_counter()
            run_once()
            timings.append(time.perf_counter() - start)
            if seconds and min(timings) > 2 * min(seconds.values()):
                break  # already twice as slow as the best count: not worth more calls (seconds each when loaded)
        seconds[threads] = round(min(timings[1:] or timings), 5)
    best = min(seconds, key=seconds.get)
    set_threads(best)
    return ThreadChoice(best, "a shared machine: the fastest measured", seconds)


def describe_load(load: MachineLoad, threads: ThreadChoice) -> str:
    """Lines for the command's output: the load, the thread choice, and when shared a warning with the advice."""
    average = "unknown" if load.load_average is None else f"{load.load_average:.2f}"
    busy = ", ".join(f"{name} (pid {pid}, {percent:.0f}%)" for name, pid, percent in load.busy[:5]) or "none"
    lines = [
        f"machine load: 1-min load average {average} on {load.usable_cores} usable core(s); other busy processes: "
        f"{busy}",
        f"threads: {threads.threads} ({threads.reason}"
        + (", " + ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in threads.seconds.items()) if threads.seconds else "")
        + ")",
    ]
    if load.shared:
        lines.append(
            f"WARNING: other processes use {load.other_cores:.1f} core(s) of {load.usable_cores}: the timings below "
            f"cannot be trusted (they can be many times slower than on a quiet machine); {ADVICE}."
        )
    return "\n".join(lines)


@contextlib.contextmanager
def timing_threads(target, print_: Callable[[str], None] = print, reader: Callable[[], MachineLoad] | None = None):
    """For the block that times generation with `target`: the machine's load read and printed, the thread count
    chosen (`choose_threads`, with one 32-token forward of `target` on CPU) and restored afterwards; yields the
    record for a report (`MachineLoad.record()` plus {"threads": ...})."""
    import torch

    previous, load = torch.get_num_threads(), (reader or read_machine_load)()
    if target.device.type == "cpu":
        ids = torch.zeros((1, 32), dtype=torch.long, device=target.device)

        def run_once() -> None:
            with torch.no_grad():
                target(ids)

        choice = choose_threads(load, run_once, previous, torch.set_num_threads)
    else:
        choice = ThreadChoice(previous, f"{target.device.type}: CPU threads do not time its forwards")
    print_(describe_load(load, choice))
    try:
        yield {**load.record(), "threads": choice.record()}
    finally:
        torch.set_num_threads(previous)
