"""Verify what the drafter is confident in: each round drafts the whole block, then verifies the prefix of its drafts
that maximises expected committed tokens per second.

The drafter scores its own drafts: draft i of a row is accepted only if drafts 1..i are, so the chance that the
target keeps it is about reach_i = q_1 ... q_i, q_j the drafter's probability of draft j (DFlash2: the selector's,
given the draft before it). A round verifying m drafts commits 1 + sum_{i<=m} reach_i tokens in expectation, and
costs one target forward over m + 1 tokens (measured: `cost_timing.py`); m = 0 is a plain decoding step. The drafter
pass is paid before the choice, so it is the same for every m. How far to trust the drafter's probabilities is
learned from the acceptance seen (`DraftCalibration`, also what sizes "auto" draft trees). Where drafting does not
pay for this prompt on this machine (the best prefix, its drafter pass counted, commits fewer tokens per second than
a plain step, on average over the recent rounds), rounds take plain steps without a drafter pass, and draft again
every `PROBE_EVERY` rounds to see whether that changed.

    drafter.block_size_policy = "confidence"        # or ConfidentPrefix(cost_model=...)

Any prefix is lossless: the target verifies whatever is sent. Under compiled verification every round with drafts
reads the block's width, so m is all drafts or none (a plain step, its own graph).

A measured cost model is corrected by the call's own rounds, each timed from one choice to the next: whether drafting
pays is weighed with the drafted rounds' modelled prices scaled by how long they took against them, and a plain
step's time once one was timed (as the adaptive block size's `calibrated_seconds`). A cost model timed while something
else ran would otherwise keep a call from drafting, or drafting where it loses. (Scaling every drafted round alike
leaves the prefix choice itself as modelled: on a quiet machine the model prices each kind of round within a few per
cent, compiled rounds ~15% under their eager prices but alike, docs/results-history.md, "Does the cost model price
the rounds the loop runs?")
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ...modeling_dflash import DFlashDraftModel
from .cost_model import CostModel, running_seconds
from .cost_timing import measured_cost_model

CALIBRATION_DECAY = 0.9  # weight kept by past rounds in the calibration of the drafter's probabilities
PROBE_EVERY = 8  # while drafting does not pay, one round in this many drafts anyway (the prompt may change)


@dataclass
class DraftCalibration:
    """Observed / predicted accepted drafts over the rounds so far (discounted by `decay` each round), shrunk toward
    1 by one round's worth of prior: the factor the drafter's reach probabilities are trusted by."""

    decay: float = CALIBRATION_DECAY
    accepted: float = 0.0  # discounted accepted drafts
    predicted: float = 0.0  # discounted expected accepted drafts
    expected: float = 0.0  # the last round's expected accepted drafts (before calibration)

    @property
    def factor(self) -> float:
        return (self.accepted + 1.0) / (self.predicted + 1.0)

    def observe(self, accepted_drafts: float) -> None:
        """The last round (expected `expected` accepted drafts) accepted this many."""
        self.accepted = self.decay * self.accepted + accepted_drafts
        self.predicted = self.decay * self.predicted + self.expected


def reach_probabilities(draft_probabilities: torch.Tensor) -> torch.Tensor:
    """(R, d) the drafter's probability of each draft -> (R, d) of reaching it: the product up to it."""
    return draft_probabilities.to(torch.float64).cumprod(-1)


def best_prefix(reach: torch.Tensor, seconds: torch.Tensor, calibration: float = 1.0, choices=None) -> int:
    """The number of drafts m to verify (0..d) that maximises sum_rows (1 + calibration * sum_{i<=m} reach_i) /
    seconds[m], the fewest on ties.

    reach (R, d): each row's chance of reaching each draft (`reach_probabilities`); seconds (>= d + 1,): a
    round verifying m drafts (a forward over m + 1 tokens); choices: the m allowed (default all 0..d)."""
    drafts = reach.shape[1]
    gain = torch.cat([reach.new_zeros(reach.shape[0], 1), reach.cumsum(-1)], 1).sum(0)  # (d + 1,)
    rate = (reach.shape[0] + calibration * gain) / seconds[: drafts + 1].to(torch.float64)
    allowed = range(drafts + 1) if choices is None else [m for m in choices if 0 <= m <= drafts]
    return max(allowed, key=lambda m: (float(rate[m]), -m))


@dataclass
class ConfidentPrefix:
    """Draft the trained block every round and verify the prefix of its drafts that maximises expected committed
    tokens per second (see the module docstring).

    cost_model: seconds of a verification pass per token count; None measures it once per model pair and machine,
    cached in `cache_dir` (default: the hf_dflash cache directory, `$HF_DFLASH_CACHE`) under `cost_models/`.
    decay: weight kept by past rounds in the calibration of the drafter's probabilities."""

    cost_model: CostModel | None = None
    cache_dir: str | Path | None = None
    decay: float = CALIBRATION_DECAY

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"ConfidentPrefix.decay must be in (0, 1], got {self.decay!r}.")

    def start(
        self, target: PreTrainedModel, drafter: DFlashDraftModel, batch_size: int, fixed_verification: bool = False
    ) -> PrefixController:
        """The controller of one `generate` call (measures or loads the cost model when none was given).
        `fixed_verification`: every round with drafts verifies the block's width (compiled verification)."""
        block_size = drafter.config.block_size
        cost_model = self.cost_model
        if cost_model is None:
            rows = sorted({1, batch_size})
            cost_model = measured_cost_model(target, drafter, rows, self.cache_dir, verification=True)
        calibrate = self.cost_model is None  # a cost model passed in is used as given
        return PrefixController(block_size, cost_model, fixed_verification, DraftCalibration(self.decay), calibrate)


@dataclass
class TimedRounds:
    """One call's timed rounds of one row count: a plain step's running time, and drafted rounds' running ratio of
    their time to their modelled price."""

    plain_seconds: float | None = None
    drafted_ratio: float | None = None


@dataclass
class PrefixController:
    """One call's prefix choice: the whole block drafted each round while drafting pays (`choose`), the drafts to
    verify chosen from their reach (`prefix`), the calibration learned from what the target accepted (`observe`);
    with `calibrate`, the rounds' wall time (from one `choose` to the next) corrects the prices of the choice to
    draft (see the module docstring)."""

    block_size: int
    cost_model: CostModel
    fixed_verification: bool
    calibration: DraftCalibration
    calibrate: bool = False
    # rows -> (seconds of a round verifying m = 0..B-1 drafts (B,), the drafter's pass at block B)
    seconds: dict[int, tuple[torch.Tensor, float]] = field(init=False, default_factory=dict)
    drafted_rate: float = field(init=False, default=0.0)  # discounted tokens/s of the drafted rounds
    drafted_weight: float = field(init=False, default=0.0)  # their discounted count
    plain_rounds: int = field(init=False, default=0)  # plain steps taken in a row because drafting did not pay
    timed: dict[int, TimedRounds] = field(init=False, default_factory=dict)  # rows -> this call's timed rounds
    pending: tuple[int, int | None, float] | None = field(init=False, default=None)  # (rows, m or None, start)

    def choose(self, rows: Sequence[int]) -> int:
        now = time.perf_counter()
        if self.pending is not None:
            self.end_round(now)
        self.pending = (len(rows), None, now)  # a plain step unless `prefix` says how many drafts it verifies
        if self.drafting_gain(len(rows)) < 0 and self.plain_rounds < PROBE_EVERY - 1:
            self.plain_rounds += 1
            return 1
        self.plain_rounds = 0
        return self.block_size

    def prices(self, rows: int) -> tuple[torch.Tensor, float]:
        """(seconds of a round verifying m = 0..B-1 drafts (B,), the drafter's pass), as modelled."""
        if rows not in self.seconds:
            verify = self.cost_model.verification_seconds_per_length(rows, self.block_size)
            if self.fixed_verification:  # every round with drafts is padded to the block's width
                verify[1:] = verify[-1]
            self.seconds[rows] = (verify, float(self.cost_model.drafter_seconds(rows, self.block_size)[-1]))
        return self.seconds[rows]

    def prefix(self, draft_probabilities: torch.Tensor) -> int:
        """How many of the drafts to verify, from the drafter's probability of each (R, d)."""
        rows, drafts = draft_probabilities.shape
        verify, _ = self.prices(rows)
        reach = reach_probabilities(draft_probabilities)
        choices = (0, drafts) if self.fixed_verification else None
        m = best_prefix(reach, verify, self.calibration.factor, choices)
        self.calibration.expected = float(reach[:, :m].sum()) / rows
        if self.pending is not None:
            self.pending = (self.pending[0], m, self.pending[2])
        return m

    def drafting_gain(self, rows: int) -> float:
        """Tokens/s the drafted rounds gained over plain steps (recent rounds weigh more), each weighed against a plain
        step's price now: its time in this call once one was timed, else as modelled. A first timed plain step thus
        re-prices every earlier round: a cost model timed after a short context prices a plain step after a long
        prompt far too cheap (SmolLM2, bf16, 4,096 tokens: ~2.8x its price at 256), where the drafted rounds are
        priced by their own timings; weighed against that price, drafting that pays would lose for several probes."""
        timed = self.timed.get(rows)
        plain_seconds = (timed.plain_seconds if timed is not None else None) or float(self.prices(rows)[0][0])
        return self.drafted_rate - self.drafted_weight / plain_seconds

    def end_round(self, now: float) -> None:
        """The round begun at the last `choose` ended: time it (with `calibrate`) and, when it drafted, count the
        tokens per second its drafting gave (`drafting_gain`)."""
        rows, m, start = self.pending
        verify, drafting = self.prices(rows)
        priced = float(verify[0]) if m is None else drafting + float(verify[m])
        timed = self.timed.setdefault(rows, TimedRounds())
        if self.calibrate and m is None:
            timed.plain_seconds = running_seconds(timed.plain_seconds, now - start)
        elif self.calibrate:
            timed.drafted_ratio = running_seconds(timed.drafted_ratio, (now - start) / priced)
        if m is None:
            return
        drafted_seconds = priced * (timed.drafted_ratio or 1.0)
        drafted = (1 + self.calibration.factor * self.calibration.expected) / drafted_seconds
        self.drafted_rate = self.calibration.decay * self.drafted_rate + drafted
        self.drafted_weight = self.calibration.decay * self.drafted_weight + 1

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        if num_drafts:
            self.calibration.observe(float(num_accepted.float().mean()))
