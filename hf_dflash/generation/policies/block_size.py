"""Adaptive block size: how many tokens to draft each round, chosen from the acceptance seen so far.

A drafter trained at block size B drafts a shorter block `[bonus, MASK x (k-1)]` for any k <= B
(k = 1: no drafter pass, a plain decoding step). Verification is unchanged, so every k is lossless;
only the speed depends on k. The adaptive policy picks the k with the most committed tokens per second:

    p_i  = P(draft slot i accepted | slots before it accepted)      running estimate per row, i = 1..B-1
    E(k) = 1 + sum_{j=1}^{k-1} prod_{i<=j} p_i                       expected tokens committed by a round
    k*   = argmax_k sum_rows E_r(k) / cost(rows, k)                  one k per round (one pass) for a batch

cost(rows, k) = drafter pass(k) + target verification pass(k) in seconds (`cost_model.py`: timed once
with the real models per (target, drafter, device, dtype, torch threads), cached as JSON).

Opt in on the drafter (a setting read by `generate`, like Transformers' assistant settings):

    drafter.block_size_policy = "adaptive"                # or AdaptiveBlockSize(decay=..., cost_model=...)
    drafter.block_size_policy = "confidence"              # the whole block drafted, its likely prefix verified
    drafter.block_size_policy = 8                         # a fixed shorter block
    drafter.block_size_policy = lambda round_index: 4     # an explicit schedule: k for each round
    drafter.block_size_policy = None                      # default: the trained block size B
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ...modeling_dflash import DFlashDraftModel
from .confidence import ConfidentPrefix
from .cost_model import CostModel, running_seconds
from .cost_timing import measured_cost_model

POLICY_ATTRIBUTE = "block_size_policy"  # the drafter attribute `generate` reads


# --- acceptance estimates (pure) ---


def update_acceptance_counts(
    successes: torch.Tensor,
    trials: torch.Tensor,
    num_drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted per-slot counts after one round.

    successes, trials (R, S): discounted accepted drafts / reached draft slots of each row, S = B - 1,
    column i = draft slot i + 1; num_drafts (R,) drafts offered to each row this round; num_accepted (R,)
    drafts it accepted. Column i was a trial when reached (i <= accepted) and offered (i < drafts); a
    success when i < accepted. Every count first decays by `decay`, reached or not, so old evidence
    fades and a slot no longer tried drifts back to its prior (which makes the policy try it again).
    """
    slots = torch.arange(successes.shape[1], device=successes.device)
    accepted = num_accepted.to(successes.device)[:, None]
    reached = (slots <= accepted) & (slots < num_drafts.to(successes.device)[:, None])
    return decay * successes + (slots < accepted), decay * trials + reached


def acceptance_probabilities(
    successes: torch.Tensor, trials: torch.Tensor, prior: float, prior_weight: float
) -> torch.Tensor:
    """p (R, S): P(slot i accepted | slots < i accepted) from the counts (R, S).

    Each slot's estimate shrinks toward a prior worth `prior_weight` trials: the first draft's toward
    `prior`, every later one's toward the estimate of the slot before it. A slot rarely reached is thus
    assumed to accept like the one before it: with the optimistic prior instead, the slots a poor drafter
    never reaches would keep long blocks attractive.
    """
    p = torch.empty_like(successes)
    previous = torch.full_like(successes[:, :1], prior)
    for slot in range(successes.shape[1]):
        column = slice(slot, slot + 1)
        previous = (successes[:, column] + prior_weight * previous) / (trials[:, column] + prior_weight)
        p[:, column] = previous
    return p


def expected_tokens(p: torch.Tensor) -> torch.Tensor:
    """E (R, S+1) from p (R, S) (column i - 1 = draft slot i): E[:, k-1] = E(k) = 1 + sum_{j=1}^{k-1}
    prod_{i<=j} p_i, the tokens committed by a round with block length k (the bonus token plus the
    expected accepted drafts)."""
    return torch.cat([torch.ones_like(p[:, :1]), 1 + p.cumprod(1).cumsum(1)], 1)


def calibrated_seconds(modelled: torch.Tensor, measured: dict[int, float]) -> torch.Tensor:
    """Seconds per block length (B,): the `measured` ones ({k: seconds} of rounds this call timed) where known; the
    `modelled` ones elsewhere, drafting rounds (k >= 2) scaled by how far the measured drafting rounds were from
    the model (the mean ratio: what the model leaves out is mostly the drafting's), k = 1 (a plain step) as
    modelled until timed."""
    calibrated = modelled.clone()
    drafting = [seconds / float(modelled[k - 1]) for k, seconds in measured.items() if k >= 2]
    if drafting:
        calibrated[1:] *= sum(drafting) / len(drafting)
    for k, seconds in measured.items():
        calibrated[k - 1] = seconds
    return calibrated


def best_block_size(expected: torch.Tensor, seconds: torch.Tensor) -> int:
    """argmax_k sum_r E_r(k) / seconds(k), the smallest k on ties. expected (R, B); seconds (B,)."""
    return int((expected.sum(0) / seconds).argmax()) + 1  # argmax returns the first maximum


# --- policies ---


class BlockSizeController(Protocol):
    """Chooses k for each round of one `generate` call and learns from the outcome."""

    def choose(self, rows: Sequence[int]) -> int:
        """k for the next round; rows: the active rows' indices in the original batch."""

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        """The round verified `num_drafts` drafts for every row in `rows`; num_accepted (R,)."""


@dataclass
class FixedBlockSize:
    """The same k every round (the default: the drafter's trained block size)."""

    block_size: int

    def choose(self, rows: Sequence[int]) -> int:
        return self.block_size

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        pass


@dataclass
class ScheduledBlockSize:
    """k = schedule(round_index) (0 = first drafting round), checked against 1 <= k <= max_block_size."""

    schedule: Callable[[int], int]
    max_block_size: int
    round_index: int = 0

    def choose(self, rows: Sequence[int]) -> int:
        k = self.schedule(self.round_index)
        if not is_block_size(k, self.max_block_size):
            raise ValueError(
                f"The block size schedule returned {k!r} for round {self.round_index}; it must return an int k "
                f"with 1 <= k <= {self.max_block_size} (the drafter's block_size)."
            )
        self.round_index += 1
        return k

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        pass


@dataclass
class AdaptiveBlockSize:
    """Choose k each round to maximise expected committed tokens per second (see the module docstring).

    decay: weight kept by past evidence each round (0.9: about the last 10 rounds count; 1: nothing is
        forgotten, and a block length once abandoned is never tried again);
    prior: the first draft's acceptance before any evidence (1.0, optimistic: the first rounds use whole
        blocks; later drafts start from the estimate of the draft before them);
    prior_weight: how many trials the prior is worth;
    cost_model: seconds per round; None measures it once per model pair and machine, cached in
    `cache_dir` (default: the hf_dflash cache directory, `$HF_DFLASH_CACHE`) under `cost_models/`.

    A measured cost model is then corrected by the call's own rounds (`calibrated_seconds`): each round is timed
    from one choice to the next, so what the model leaves out (the loop's glue, logits processing, a shorter
    context, another dtype's kernels) is priced in, and where drafting does not pay for this prompt on this
    machine the rounds fall back to k = 1 (plain decoding steps) until the acceptance estimates, decaying back
    to the prior, try a block again. (Measured, bf16 on a 2-core Zen 5, the demo's chat prompt: the model priced
    a 3-token round at 28 ms where it took 42, and a plain step at 23, so DFlash ran at 0.70x plain.) A cost model
    passed in is used as given.
    """

    decay: float = 0.9
    prior: float = 1.0
    prior_weight: float = 1.0
    cost_model: CostModel | None = None
    cache_dir: str | Path | None = None

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"AdaptiveBlockSize.decay must be in (0, 1], got {self.decay!r}.")
        if not 0 <= self.prior <= 1:
            raise ValueError(f"AdaptiveBlockSize.prior is a probability in [0, 1], got {self.prior!r}.")
        if not self.prior_weight > 0:
            raise ValueError(f"AdaptiveBlockSize.prior_weight must be > 0, got {self.prior_weight!r}.")

    def start(
        self, target: PreTrainedModel, drafter: DFlashDraftModel, batch_size: int, fixed_verification: bool = False
    ) -> AdaptiveController:
        """The controller of one `generate` call (measures or loads the cost model when none was given).
        `fixed_verification`: every round verifies B tokens (compiled verification pads to one shape), so a
        shorter block saves only drafting (`CostModel.at_fixed_verification`)."""
        cost_model = self.cost_model
        if cost_model is None:
            rows = sorted({1, batch_size})
            cost_model = measured_cost_model(target, drafter, rows, self.cache_dir, verification=fixed_verification)
        if fixed_verification:
            cost_model = cost_model.at_fixed_verification(drafter.config.block_size)
        calibrate = self.cost_model is None
        return AdaptiveController(self, drafter.config.block_size, batch_size, cost_model, calibrate)


@dataclass
class AdaptiveController:
    """Per-row acceptance counts of one `generate` call and the argmax of tokens per second; with `calibrate`,
    the wall time of its rounds (from one `choose` to the next) corrects the cost model."""

    policy: AdaptiveBlockSize
    max_block_size: int
    batch_size: int
    cost_model: CostModel
    calibrate: bool = False
    successes: torch.Tensor = field(init=False)  # (batch, B-1) discounted
    trials: torch.Tensor = field(init=False)  # (batch, B-1) discounted
    seconds: dict[int, torch.Tensor] = field(init=False, default_factory=dict)  # rows -> (B,)
    measured: dict[int, dict[int, float]] = field(init=False, default_factory=dict)  # rows -> {k: seconds}
    pending: tuple[int, int, float] | None = field(init=False, default=None)  # (rows, k, start) of the last round

    def __post_init__(self):
        self.successes = torch.zeros(self.batch_size, self.max_block_size - 1, dtype=torch.float64)
        self.trials = torch.zeros_like(self.successes)

    def choose(self, rows: Sequence[int]) -> int:
        now = time.perf_counter()
        if self.calibrate and self.pending is not None:
            rows_before, k_before, start = self.pending
            self.time_round(rows_before, k_before, now - start)
        if len(rows) not in self.seconds:
            self.seconds[len(rows)] = self.cost_model.round_seconds(len(rows), self.max_block_size)
        seconds = calibrated_seconds(self.seconds[len(rows)], self.measured.get(len(rows), {}))
        index = list(rows)
        p = acceptance_probabilities(
            self.successes[index], self.trials[index], self.policy.prior, self.policy.prior_weight
        )
        k = best_block_size(expected_tokens(p), seconds)
        if self.calibrate and not any(timed >= 2 for timed in self.measured.get(len(rows), {})):
            # No drafting round timed yet in this call: draft a whole block, whatever the model says, so that its
            # drafting rounds are calibrated (a model that overprices them would otherwise never be corrected).
            k = self.max_block_size
        self.pending = (len(rows), k, now)
        return k

    def time_round(self, rows: int, k: int, seconds: float) -> None:
        """A round of `rows` rows at block length k took `seconds` (a running average per k, recent rounds first)."""
        measured = self.measured.setdefault(rows, {})
        measured[k] = running_seconds(measured.get(k), seconds)

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        index = list(rows)
        offered = torch.full((len(index),), num_drafts)
        self.successes[index], self.trials[index] = update_acceptance_counts(
            self.successes[index], self.trials[index], offered, num_accepted.cpu(), self.policy.decay
        )


def is_block_size(k, max_block_size: int) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= max_block_size


def block_size_policy(drafter: DFlashDraftModel, unset=None):
    """The drafter's block size policy, normalised: `drafter.block_size_policy`, else the one its config recommends
    (`DFlashConfig.block_size_policy`), else `unset` (chains: None, the trained block; hybrid drafting:
    "adaptive"); "adaptive" becomes `AdaptiveBlockSize()`."""
    # An optional user setting on our own model class, not state: unset means the config's recommendation.
    policy = getattr(drafter, POLICY_ATTRIBUTE, None)
    if policy is None:
        policy = getattr(drafter.config, "block_size_policy", None)
    if policy is None:
        policy = unset
    if isinstance(policy, str) and policy == "adaptive":
        return AdaptiveBlockSize()
    if isinstance(policy, str) and policy == "confidence":
        return ConfidentPrefix()
    return policy


def sizing_its_own_drafts(policy):
    """The block policy of a strategy that sizes its drafts itself (trees, the hybrid budget): a chain's confident
    prefix (`ConfidentPrefix`) becomes the adaptive block size; other policies stay."""
    if isinstance(policy, ConfidentPrefix):
        return AdaptiveBlockSize(cost_model=policy.cost_model, cache_dir=policy.cache_dir)
    return policy


def block_size_controller(
    drafter: DFlashDraftModel,
    target: PreTrainedModel,
    batch_size: int,
    fixed_verification: bool = False,
    trees: bool = False,
) -> BlockSizeController:
    """The controller for one `generate` call from `drafter.block_size_policy`; unset, the policy the
    drafter's config recommends (`DFlashConfig.block_size_policy`); neither: fixed B.

    Accepted policies: None (the trained block size B), an int 1 <= k <= B, "adaptive", an
    `AdaptiveBlockSize`, "confidence", a `ConfidentPrefix` (`confidence.py`), or a callable round_index -> k.
    Anything else raises ValueError. `fixed_verification`: every round verifies B tokens (compiled verification;
    `AdaptiveBlockSize.start`). `trees`: the block of a drafter tree, which sizes itself (`sizing_its_own_drafts`).
    """
    max_block_size = drafter.config.block_size
    policy = block_size_policy(drafter)
    if trees:
        policy = sizing_its_own_drafts(policy)
    if policy is None:
        return FixedBlockSize(max_block_size)
    if isinstance(policy, (AdaptiveBlockSize, ConfidentPrefix)):
        return policy.start(target, drafter, batch_size, fixed_verification)
    if is_block_size(policy, max_block_size):
        return FixedBlockSize(policy)
    if callable(policy):
        return ScheduledBlockSize(policy, max_block_size)
    raise ValueError(
        f"drafter.block_size_policy = {policy!r} is not a block size policy. Use None (the trained block size "
        f"{max_block_size}), an int k with 1 <= k <= {max_block_size}, 'adaptive', an AdaptiveBlockSize(...), "
        "'confidence', a ConfidentPrefix(...), or a callable round_index -> k."
    )


def parse_block_size_policy(text: str, max_block_size: int) -> str | int | None:
    """A command-line policy: "recommended" (None: the drafter config's `block_size_policy`, else B),
    "trained" (B), "adaptive", "confidence", or an int 1 <= k <= B; ValueError naming the value otherwise."""
    if text == "recommended":
        return None
    if text == "trained":
        return max_block_size
    if text in ("adaptive", "confidence"):
        return text
    if text.isdigit() and is_block_size(int(text), max_block_size):
        return int(text)
    raise ValueError(
        f"block size policy {text!r}: use 'recommended' (the drafter config's), 'trained' (the drafter's block "
        f"size {max_block_size}), 'adaptive', 'confidence', "
        f"or a block length k with 1 <= k <= {max_block_size}."
    )
