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
    drafter.block_size_policy = 8                         # a fixed shorter block
    drafter.block_size_policy = lambda round_index: 4     # an explicit schedule: k for each round
    drafter.block_size_policy = None                      # default: the trained block size B
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ..modeling_dflash import DFlashDraftModel
from .cost_model import CostModel, measured_cost_model
from .ngram import MATCH_BUCKETS, match_bucket

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

    def start(self, target: PreTrainedModel, drafter: DFlashDraftModel, batch_size: int) -> AdaptiveController:
        """The controller of one `generate` call (measures or loads the cost model when none was given)."""
        cost_model = self.cost_model
        if cost_model is None:
            cost_model = measured_cost_model(target, drafter, sorted({1, batch_size}), self.cache_dir)
        return AdaptiveController(self, drafter.config.block_size, batch_size, cost_model)


@dataclass
class AdaptiveController:
    """Per-row acceptance counts of one `generate` call and the argmax of tokens per second."""

    policy: AdaptiveBlockSize
    max_block_size: int
    batch_size: int
    cost_model: CostModel
    successes: torch.Tensor = field(init=False)  # (batch, B-1) discounted
    trials: torch.Tensor = field(init=False)  # (batch, B-1) discounted
    seconds: dict[int, torch.Tensor] = field(init=False, default_factory=dict)  # rows -> (B,)

    def __post_init__(self):
        self.successes = torch.zeros(self.batch_size, self.max_block_size - 1, dtype=torch.float64)
        self.trials = torch.zeros_like(self.successes)

    def choose(self, rows: Sequence[int]) -> int:
        if len(rows) not in self.seconds:
            self.seconds[len(rows)] = self.cost_model.round_seconds(len(rows), self.max_block_size)
        index = list(rows)
        p = acceptance_probabilities(
            self.successes[index], self.trials[index], self.policy.prior, self.policy.prior_weight
        )
        return best_block_size(expected_tokens(p), self.seconds[len(rows)])

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        index = list(rows)
        offered = torch.full((len(index),), num_drafts)
        self.successes[index], self.trials[index] = update_acceptance_counts(
            self.successes[index], self.trials[index], offered, num_accepted.cpu(), self.policy.decay
        )


def is_block_size(k, max_block_size: int) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= max_block_size


def block_size_controller(drafter: DFlashDraftModel, target: PreTrainedModel, batch_size: int) -> BlockSizeController:
    """The controller for one `generate` call from `drafter.block_size_policy`; unset, the policy the
    drafter's config recommends (`DFlashConfig.block_size_policy`); neither: fixed B.

    Accepted policies: None (the trained block size B), an int 1 <= k <= B, "adaptive", an
    `AdaptiveBlockSize`, or a callable round_index -> k. Anything else raises ValueError.
    """
    max_block_size = drafter.config.block_size
    # An optional user setting on our own model class, not state: unset means the config's recommendation.
    policy = getattr(drafter, POLICY_ATTRIBUTE, None)
    if policy is None:
        policy = getattr(drafter.config, "block_size_policy", None)
    if policy is None:
        return FixedBlockSize(max_block_size)
    if isinstance(policy, str) and policy == "adaptive":
        policy = AdaptiveBlockSize()
    if isinstance(policy, AdaptiveBlockSize):
        return policy.start(target, drafter, batch_size)
    if is_block_size(policy, max_block_size):
        return FixedBlockSize(policy)
    if callable(policy):
        return ScheduledBlockSize(policy, max_block_size)
    raise ValueError(
        f"drafter.block_size_policy = {policy!r} is not a block size policy. Use None (the trained block size "
        f"{max_block_size}), an int k with 1 <= k <= {max_block_size}, 'adaptive', an AdaptiveBlockSize(...), "
        "or a callable round_index -> k."
    )


def parse_block_size_policy(text: str, max_block_size: int) -> str | int | None:
    """A command-line policy: "recommended" (None: the drafter config's `block_size_policy`, else B),
    "trained" (B), "adaptive", or an int 1 <= k <= B; ValueError naming the value otherwise."""
    if text == "recommended":
        return None
    if text == "trained":
        return max_block_size
    if text == "adaptive":
        return "adaptive"
    if text.isdigit() and is_block_size(int(text), max_block_size):
        return int(text)
    raise ValueError(
        f"block size policy {text!r}: use 'recommended' (the drafter config's), 'trained' (the drafter's block "
        f"size {max_block_size}), 'adaptive', "
        f"or a block length k with 1 <= k <= {max_block_size}."
    )


# --- hybrid drafting: how many DFlash and n-gram drafts a round's tree holds ---

# The prior of the block's gain beside n-gram drafts, per match bucket (1, 2-3, >= 4 tokens), as a share of
# `AdaptiveBlockSize.prior`: the longer the match, the likelier the copy is right and the block redundant.
# A block is costly to try (its first pass reads the whole prompt's features), so beside a long match it
# starts pessimistic and is drafted only where the n-gram estimate of that bucket falls.
BESIDE_NGRAM_PRIOR_SCALES = (1.0, 0.5, 0.25)


def best_tree_size(
    expected_block: torch.Tensor, ngram_gain: torch.Tensor, seconds: torch.Tensor, one_branch: bool
) -> tuple[int, int]:
    """(k, m) = argmax (E_block(k) + G(m)) / seconds(k, m), the smallest k, then m, on ties.

    expected_block (B,): E_block(k) at k = 1..B, tokens a round with block length k commits from the block
    (bonus included); ngram_gain (M+1,): G(m), expected accepted n-gram drafts when m are offered (G(0) = 0);
    seconds (B, M+1): seconds of a round with k and m (`CostModel.tree_round_seconds`). The two branches'
    accepted drafts are counted as exclusive (they are, unless their first drafts agree, and then the tree
    shares those nodes and costs less). one_branch: only k = 1 or m = 0 (the branch is chosen before
    verification: sampling, or a target that cannot verify a tree).
    """
    score = (expected_block[:, None] + ngram_gain[None, :]) / seconds
    if one_branch:
        allowed = torch.zeros_like(score, dtype=torch.bool)
        allowed[0, :] = allowed[:, 0] = True
        score = score.masked_fill(~allowed, float("-inf"))
    index = int(score.flatten().argmax())  # the first maximum: smallest k, then smallest m
    return index // score.shape[1] + 1, index % score.shape[1]


@dataclass
class BranchEstimate:
    """Discounted per-slot acceptance counts of one draft branch (the estimator of `AdaptiveBlockSize`).

    chained: a slot rarely reached is assumed to accept like the slot before it (right for a model's
    drafts, whose acceptance falls with depth); otherwise each slot shrinks toward the prior on its own
    (right for a copy, which once right for a few tokens tends to stay right: its later slots, cheap to
    verify, are then offered until evidence says otherwise)."""

    slots: int
    settings: AdaptiveBlockSize
    chained: bool = True
    successes: torch.Tensor = field(init=False)  # (1, slots)
    trials: torch.Tensor = field(init=False)  # (1, slots)

    def __post_init__(self):
        self.successes = torch.zeros(1, self.slots, dtype=torch.float64)
        self.trials = torch.zeros_like(self.successes)

    def expected_tokens(self) -> torch.Tensor:
        """(slots + 1,): 1 + expected accepted drafts when 0..slots are offered."""
        prior, weight = self.settings.prior, self.settings.prior_weight
        if self.chained:
            p = acceptance_probabilities(self.successes, self.trials, prior, weight)
        else:
            p = (self.successes + weight * prior) / (self.trials + weight)
        return expected_tokens(p)[0]

    def observe(self, compared: int, agreed: int) -> None:
        """The branch's first `compared` drafts were checked against the committed tokens; `agreed` of them
        (a prefix) matched."""
        self.successes, self.trials = update_acceptance_counts(
            self.successes, self.trials, torch.tensor([compared]), torch.tensor([agreed]), self.settings.decay
        )


@dataclass
class TreeBudget:
    """Chooses, each round of one hybrid `generate` call, the block length k and the n-gram drafts m.

    Both branches keep running acceptance estimates (as the adaptive block size does). With a cost model
    (adaptive policy), (k, m) maximises expected committed tokens per second (`best_tree_size`): where a
    bigger tree costs more than its expected extra tokens are worth, the tree stays small. With a fixed k
    or a schedule (`block`), the tree holds that block and every n-gram draft found; when one branch
    must be chosen, the one with more expected tokens.

    Estimates are kept per context. The n-gram branch's per match-length bucket (`ngram.match_bucket`: a
    4-token match is a copy, a 1-token match a guess). Beside an n-gram continuation the block is worth
    only the drafts it gets accepted beyond the n-gram branch (where both agree the tree shares their
    nodes; where the n-gram branch wins the block's drafts were wasted): in a tree, rounds with n-gram
    drafts keep their own block estimate of that gain per bucket (a round counts the block's accepted
    drafts if they beat the n-gram branch's, else none), apart from rounds without n-gram drafts. When one
    branch is verified, the block is worth all its accepted drafts: only the estimate without n-gram
    drafts is used for it.
    """

    max_block_size: int
    max_ngram_tokens: int
    one_branch: bool
    settings: AdaptiveBlockSize
    cost_model: CostModel | None = None
    block: BlockSizeController | None = None
    block_estimate: BranchEstimate = field(init=False)  # the block, without n-gram drafts beside it
    block_beside_ngram: list[BranchEstimate] = field(init=False)  # per match bucket: its gain over them
    ngram_estimates: list[BranchEstimate] = field(init=False)  # per match bucket
    seconds: torch.Tensor | None = field(init=False, default=None)  # (B, M+1)
    bucket: int | None = field(init=False, default=None)  # the last `choose`'s match bucket (None: no match)

    def __post_init__(self):
        if (self.cost_model is None) == (self.block is None):
            raise ValueError("TreeBudget needs exactly one of cost_model (adaptive) or block (a fixed k or schedule).")
        self.block_estimate = BranchEstimate(self.max_block_size - 1, self.settings)
        self.block_beside_ngram = [
            BranchEstimate(self.max_block_size - 1, replace(self.settings, prior=self.settings.prior * scale))
            for scale in BESIDE_NGRAM_PRIOR_SCALES
        ]
        self.ngram_estimates = [
            BranchEstimate(self.max_ngram_tokens, self.settings, chained=False) for _ in MATCH_BUCKETS
        ]
        if self.cost_model is not None:
            self.seconds = self.cost_model.tree_round_seconds(1, self.max_block_size, self.max_ngram_tokens)

    def choose(self, ngram_found: int, block_allowed: bool = True, match_length: int = 1) -> tuple[int, int]:
        """(k, m) for the next round, given that `ngram_found` n-gram drafts are available (m <= ngram_found)
        from a suffix match of `match_length` tokens; k = 1 when the block is not allowed (the prefill: the
        drafter has no context features yet)."""
        self.bucket = match_bucket(match_length) if ngram_found else None
        beside = self.bucket is not None and not self.one_branch
        block_estimate = self.block_beside_ngram[self.bucket] if beside else self.block_estimate
        expected_block = block_estimate.expected_tokens()[: self.max_block_size if block_allowed else 1]
        ngram_estimate = self.ngram_estimates[self.bucket or 0]
        gain = ngram_estimate.expected_tokens()[: ngram_found + 1] - 1
        if self.block is None:
            seconds = self.seconds[: len(expected_block), : ngram_found + 1]
            return best_tree_size(expected_block, gain, seconds, self.one_branch)
        if not block_allowed:
            return 1, ngram_found
        k = self.block.choose([0])
        if not self.one_branch or not ngram_found:
            return k, ngram_found
        return (k, 0) if expected_block[k - 1] >= 1 + gain[-1] else (1, ngram_found)

    def observe(self, block_compared: int, block_agreed: int, ngram_compared: int, ngram_agreed: int) -> None:
        """Each branch's drafts checked against the round's committed tokens (see `BranchEstimate.observe`),
        in the context of the last `choose`. Rounds without an n-gram continuation leave its estimates alone."""
        if self.bucket is not None and not self.one_branch:
            # Only rounds that drafted the block count (no drift back to the prior while it is not drafted):
            # beside a reliable copy it would otherwise be retried every few rounds, for nothing. Whether it
            # is drafted still follows the n-gram branch's estimate, which every round with a match updates.
            if block_compared:
                gain = block_agreed if block_agreed > ngram_agreed else 0
                self.block_beside_ngram[self.bucket].observe(block_compared, gain)
        else:
            self.block_estimate.observe(block_compared, block_agreed)
        if self.bucket is not None and ngram_compared:
            self.ngram_estimates[self.bucket].observe(ngram_compared, ngram_agreed)
        if self.block is not None:
            self.block.observe([0], block_compared, torch.tensor([block_agreed]))


def tree_budget(
    drafter: DFlashDraftModel, target: PreTrainedModel, max_ngram_tokens: int, one_branch: bool
) -> TreeBudget:
    """The budget of one hybrid `generate` call from `drafter.block_size_policy`: None or "adaptive" (the
    default here: the cost model measured once per pair and machine, verification passes included), an
    `AdaptiveBlockSize`, a fixed k or a schedule (tree = that block + every n-gram draft found)."""
    policy = getattr(drafter, POLICY_ATTRIBUTE, None)
    if policy is None or (isinstance(policy, str) and policy == "adaptive"):
        policy = AdaptiveBlockSize()
    max_block_size = drafter.config.block_size
    if isinstance(policy, AdaptiveBlockSize):
        cost_model = policy.cost_model
        if cost_model is None:
            cost_model = measured_cost_model(target, drafter, (1,), policy.cache_dir, verification=True)
        return TreeBudget(max_block_size, max_ngram_tokens, one_branch, policy, cost_model=cost_model)
    block = block_size_controller(drafter, target, batch_size=1)  # a fixed k or a schedule; bad ones raise
    return TreeBudget(max_block_size, max_ngram_tokens, one_branch, AdaptiveBlockSize(), block=block)
