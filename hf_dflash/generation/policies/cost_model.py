"""The cost model of the adaptive block size: seconds of one DFlash round per block length k and batch rows.

A round = drafter pass(k) + target verification pass(k), measured at a few k (`cost_timing.py` times
them with the real models and caches them) and interpolated here for any k and row count. Hybrid drafting
(a DFlash block plus n-gram drafts, verified as one tree) also needs the target verification pass alone
over n tokens, up to 2B: a round with block length k and m n-gram nodes costs
round(k) + verify(k + m) - verify(k). Everything here is pure arithmetic on measured tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MEASURED_BLOCK_LENGTHS = (1, 2, 4, 8, 16)
ROUND_TIME_DECAY = 0.8  # weight earlier timings of a round keep when another comes (timing noise vs a changing context)
MEASURED_VERIFICATION_LENGTHS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64)


def running_seconds(previous: float | None, seconds: float) -> float:
    """A round's running time in one call: `seconds` when it is the first timing, else recent timings weigh more
    (`ROUND_TIME_DECAY`)."""
    return seconds if previous is None else ROUND_TIME_DECAY * previous + (1 - ROUND_TIME_DECAY) * seconds


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through the points (xs increasing), extended linearly past both ends."""
    if len(xs) == 1:
        return float(ys[0])
    right = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class CostModel:
    """Seconds of one round (drafter pass + target verification) per block length k and batch rows.

    block_lengths: the measured k, increasing, starting at 1 (k = 1: verification only, no drafter);
    seconds: rows -> seconds at each of `block_lengths`. Other k are interpolated linearly (extended
    past the last measured k); other row counts linearly between measured ones, proportionally above
    the largest and as the smallest below it.
    """

    block_lengths: tuple[int, ...]
    seconds: dict[int, tuple[float, ...]]
    verification_lengths: tuple[int, ...] = ()
    verification_seconds: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # rows -> seconds of the drafter's pass alone at each of `block_lengths` (0 at k = 1): what a round costs
    # beyond its verification when that has one fixed width (`at_fixed_verification`)
    drafting_seconds: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self):
        lengths = check_table("seconds", self.block_lengths, self.seconds, "block length")
        object.__setattr__(self, "block_lengths", lengths)
        object.__setattr__(self, "seconds", {rows: tuple(map(float, v)) for rows, v in sorted(self.seconds.items())})
        if self.verification_lengths or self.verification_seconds:
            verified = check_table(
                "verification_seconds", self.verification_lengths, self.verification_seconds, "token count"
            )
            object.__setattr__(self, "verification_lengths", verified)
            table = {rows: tuple(map(float, v)) for rows, v in sorted(self.verification_seconds.items())}
            object.__setattr__(self, "verification_seconds", table)
        for rows, values in self.drafting_seconds.items():
            if rows not in self.seconds or len(values) != len(self.block_lengths) or not all(v >= 0 for v in values):
                raise ValueError(
                    f"CostModel.drafting_seconds[{rows!r}] = {values!r} must hold {len(self.block_lengths)} seconds >= 0 "
                    f"(one per block length {self.block_lengths}) for a row count timed in `seconds`."
                )
        table = {rows: tuple(map(float, v)) for rows, v in sorted(self.drafting_seconds.items())}
        object.__setattr__(self, "drafting_seconds", table)

    @classmethod
    def from_function(
        cls,
        seconds: Callable[[int], float],
        max_block_size: int,
        verification: Callable[[int], float] | None = None,
        max_verified_tokens: int | None = None,
    ) -> CostModel:
        """A batch-1 model from `seconds(k)` at k = 1..max_block_size and, when given, `verification(n)` at
        n = 1..max_verified_tokens (default 2 * max_block_size): a cost model a user knows for their machine
        (`AdaptiveBlockSize(cost_model=CostModel.from_function(...))`), and the synthetic ones of the tests."""
        lengths = tuple(range(1, max_block_size + 1))
        if verification is None:
            return cls(lengths, {1: tuple(seconds(k) for k in lengths)})
        verified = tuple(range(1, (max_verified_tokens or 2 * max_block_size) + 1))
        return cls(
            lengths, {1: tuple(seconds(k) for k in lengths)}, verified, {1: tuple(verification(n) for n in verified)}
        )

    @property
    def has_verification(self) -> bool:
        return bool(self.verification_seconds)

    def round_seconds(self, rows: int, max_block_size: int) -> torch.Tensor:
        """(max_block_size,) float64: seconds of a round with block length k = 1..max_block_size."""
        return interpolated(self.block_lengths, self.seconds, rows, max_block_size)

    def verification_seconds_per_length(self, rows: int, max_tokens: int) -> torch.Tensor:
        """(max_tokens,) float64: seconds of one target verification pass over n = 1..max_tokens tokens.
        Without measured verification times, the round times stand in for them (their growth with k is
        then the growth of the verification pass plus the drafter's)."""
        if not self.has_verification:
            return interpolated(self.block_lengths, self.seconds, rows, max_tokens)
        return interpolated(self.verification_lengths, self.verification_seconds, rows, max_tokens)

    def tree_round_seconds(self, rows: int, max_block_size: int, max_ngram_tokens: int) -> torch.Tensor:
        """(max_block_size, max_ngram_tokens + 1) float64: seconds of a round with block length k (row k - 1)
        and m n-gram drafts beside the block (column m): round(k) + verify(k + m) - verify(k)."""
        rounds = self.round_seconds(rows, max_block_size)
        verify = self.verification_seconds_per_length(rows, max_block_size + max_ngram_tokens)
        nodes = torch.arange(1, max_block_size + 1)[:, None] + torch.arange(max_ngram_tokens + 1)[None]
        return rounds[:, None] + verify[nodes - 1] - verify[nodes[:, :1] - 1]

    def drafter_seconds(self, rows: int, max_block_size: int) -> torch.Tensor:
        """(max_block_size,) float64: seconds of the drafter's pass at block length k = 1..max_block_size (0 at
        k = 1): timed alone where `drafting_seconds` has these rows (interpolated like the rounds), else read off
        as round(k) - verify(k), at least 0 (needs verification times)."""
        timed = self.drafting_seconds.get(rows)
        if timed is not None:
            values = [interpolate(k, self.block_lengths, timed) for k in range(1, max_block_size + 1)]
            return torch.tensor(values, dtype=torch.float64)
        rounds = self.round_seconds(rows, max_block_size)
        drafting = (rounds - self.verification_seconds_per_length(rows, max_block_size)).clamp_min(0)
        drafting[0] = 0.0
        return drafting

    def at_fixed_verification(self, width: int) -> CostModel:
        """The same rounds when every verification pass of drafts reads `width` tokens, as compiled verification
        does (one input shape: shorter rounds are padded): verify(n) = verify(width) for every n >= 2, and a round
        of block length k >= 2 costs its drafting + verify(width): the drafter's pass timed alone
        (`drafting_seconds`), else round(k) - verify(k), at least 0. With this cost, a longer block or a larger
        tree costs only its drafter pass. A plain step (k = 1, one token, no drafts) keeps its own cost: compiled
        verification runs it as its own graph of width 1, as plain decoding does. Needs measured verification
        passes (`measured_cost_model(..., verification=True)`)."""
        if not self.has_verification:
            raise ValueError(
                "CostModel.at_fixed_verification needs the verification pass timed alone: measure the cost model "
                "with measured_cost_model(..., verification=True)."
            )
        seconds, verification = {}, {}
        for rows in sorted(set(self.seconds) | set(self.verification_seconds)):
            verify = self.verification_seconds_per_length(rows, max(width, *self.block_lengths))
            fixed = float(verify[width - 1])
            step = float(self.round_seconds(rows, 1)[0])
            drafting = self.drafter_seconds(rows, self.block_lengths[-1])
            seconds[rows] = tuple(step if k == 1 else float(drafting[k - 1]) + fixed for k in self.block_lengths)
            verification[rows] = tuple(float(verify[0]) if n == 1 else fixed for n in self.verification_lengths)
        return CostModel(self.block_lengths, seconds, self.verification_lengths, verification)

    def to_dict(self) -> dict:
        data = {
            "block_lengths": list(self.block_lengths),
            "seconds": {str(r): list(v) for r, v in self.seconds.items()},
        }
        if self.has_verification:
            data["verification_lengths"] = list(self.verification_lengths)
            data["verification_seconds"] = {str(r): list(v) for r, v in self.verification_seconds.items()}
        if self.drafting_seconds:
            data["drafting_seconds"] = {str(r): list(v) for r, v in self.drafting_seconds.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """Inverse of `to_dict`; ValueError (or KeyError/TypeError) on a malformed dict."""
        return cls(
            tuple(data["block_lengths"]),
            {int(r): tuple(v) for r, v in data["seconds"].items()},
            tuple(data.get("verification_lengths", ())),
            {int(r): tuple(v) for r, v in data.get("verification_seconds", {}).items()},
            {int(r): tuple(v) for r, v in data.get("drafting_seconds", {}).items()},
        )


def check_table(name: str, lengths: Sequence[int], seconds: dict, unit: str) -> tuple[int, ...]:
    """ValueError unless `lengths` increase from 1 and `seconds` maps row counts >= 1 to one positive
    number per length; returns the lengths as a tuple."""
    lengths = tuple(lengths)
    label = "block_lengths" if name == "seconds" else "verification_lengths"
    if not lengths or lengths[0] != 1 or any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"CostModel.{label} must increase from 1, got {lengths!r}.")
    if not seconds:
        raise ValueError(f"CostModel.{name} is empty; give {{rows: seconds per {unit}}}.")
    for rows, values in seconds.items():
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"CostModel.{name} keys are row counts >= 1, got {rows!r}.")
        if len(values) != len(lengths) or not all(value > 0 for value in values):
            raise ValueError(
                f"CostModel.{name}[{rows}] = {values!r} must hold {len(lengths)} positive seconds "
                f"(one per {unit} {lengths})."
            )
    return lengths


def interpolated(lengths: tuple[int, ...], table: dict[int, tuple[float, ...]], rows: int, size: int) -> torch.Tensor:
    """(size,) float64: table's seconds at 1..size for `rows` rows, interpolated in length (extended
    linearly past the last) and in rows (proportionally above the largest, as the smallest below it)."""
    measured = sorted(table)
    scale = 1.0
    if rows >= measured[-1]:
        scale, per_length = rows / measured[-1], table[measured[-1]]
    elif rows <= measured[0]:
        per_length = table[measured[0]]
    else:
        per_length = [interpolate(rows, measured, [table[r][i] for r in measured]) for i in range(len(lengths))]
    values = [scale * interpolate(k, lengths, per_length) for k in range(1, size + 1)]
    if min(values) <= 0:
        raise ValueError(f"The cost model extrapolates to non-positive seconds {values} for {rows} rows.")
    return torch.tensor(values, dtype=torch.float64)


def measured_block_lengths(block_size: int) -> tuple[int, ...]:
    """The k timed for a drafter of block size B: 1, 2, 4, 8, 16 up to B, and B."""
    return tuple(sorted({k for k in MEASURED_BLOCK_LENGTHS if k <= block_size} | {block_size}))


def measured_verification_lengths(block_size: int, max_tokens: int | None = None) -> tuple[int, ...]:
    """The token counts n of the verification pass timed for draft trees: 1, 2, 4, 8, 12, ..., 64 up to the
    largest tree, B and that size; by default 2B (hybrid drafting: the block and at most about as many
    n-gram drafts)."""
    largest = max(2 * block_size, max_tokens or 0)
    return tuple(sorted({n for n in MEASURED_VERIFICATION_LENGTHS if n <= largest} | {block_size, largest}))
