"""The budget of hybrid drafting (`drafting/strategies/hybrid.py`): how many drafts the DFlash block and the n-gram
continuation each offer per round, from running acceptance estimates and (adaptive policy) the measured cost
of the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from ...modeling_dflash import DFlashDraftModel
from ..drafting.ngram import MATCH_BUCKETS, match_bucket
from .block_size import (
    AdaptiveBlockSize,
    BlockSizeController,
    acceptance_probabilities,
    block_size_controller,
    block_size_policy,
    expected_tokens,
    sizing_its_own_drafts,
    update_acceptance_counts,
)
from .cost_model import CostModel
from .cost_timing import measured_cost_model

# The prior of the block's gain beside n-gram drafts, per match bucket (1, 2-3, >= 4 tokens), as a share of
# `AdaptiveBlockSize.prior`: the longer the match, the likelier the copy is right and the block redundant.
# A block is costly to try (its first pass reads the whole prompt's features), so beside a long match it
# starts pessimistic and is drafted only where the n-gram estimate of that bucket falls.
BESIDE_NGRAM_PRIOR_SCALES = (1.0, 0.5, 0.25)


def best_split(
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

    A slot rarely reached is assumed to accept like the slot before it, for a model's drafts and a copy's
    alike. (Each copy slot shrinking toward the optimistic prior on its own, as before, assumed that a copy
    once right stays right: on prompts with few good matches its deep slots, hardly ever reached, kept
    estimates near 1, and 10 n-gram drafts were predicted to add 3.7 tokens a round where they added 0.29:
    docs/results-history.md, "Hybrid budget: copy slots estimated like the block's".)"""

    slots: int
    settings: AdaptiveBlockSize
    successes: torch.Tensor = field(init=False)  # (1, slots)
    trials: torch.Tensor = field(init=False)  # (1, slots)

    def __post_init__(self):
        self.successes = torch.zeros(1, self.slots, dtype=torch.float64)
        self.trials = torch.zeros_like(self.successes)

    def expected_tokens(self) -> torch.Tensor:
        """(slots + 1,): 1 + expected accepted drafts when 0..slots are offered."""
        prior, weight = self.settings.prior, self.settings.prior_weight
        return expected_tokens(acceptance_probabilities(self.successes, self.trials, prior, weight))[0]

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
    (adaptive policy), (k, m) maximises expected committed tokens per second (`best_split`): where a
    bigger tree costs more than its expected extra tokens are worth, the tree stays small. With a fixed k
    or a schedule (`block`), the tree holds that block and every n-gram draft found; when one branch
    must be chosen, the one with more expected tokens.

    Estimates are kept per context. The n-gram branch's per match-length bucket (`drafting/ngram.py:match_bucket`: a
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
    measured: CostModel | None = None  # the measured cost model behind a fixed-verification `cost_model`
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
        self.ngram_estimates = [BranchEstimate(self.max_ngram_tokens, self.settings) for _ in MATCH_BUCKETS]
        if self.cost_model is not None:
            self.seconds = self.cost_model.tree_round_seconds(1, self.max_block_size, self.max_ngram_tokens)

    def verify_at(self, width: int) -> None:
        """Every round from now on verifies `width` tokens (compiled verification, once a one-size drafter tree
        has chosen its size): the cost model becomes the measured one at that fixed width. A fixed k or a
        schedule weighs no cost: nothing changes."""
        if self.cost_model is None:
            return
        if self.measured is None:
            raise ValueError("TreeBudget.verify_at needs the measured cost model (TreeBudget(measured=...)).")
        self.cost_model = self.measured.at_fixed_verification(width)
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
            return best_split(expected_block, gain, seconds, self.one_branch)
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
    drafter: DFlashDraftModel,
    target: PreTrainedModel,
    max_ngram_tokens: int,
    one_branch: bool,
    verification_width: int | None = None,
) -> TreeBudget:
    """The budget of one hybrid `generate` call from the drafter's block size policy (`block_size_policy`): unset,
    "adaptive" or "confidence" (the default here: the cost model measured once per pair and machine, verification
    passes included; the budget weighs both branches itself, so a chain's confident prefix becomes the adaptive
    budget), an `AdaptiveBlockSize`, a fixed k or a schedule (tree = that block + every n-gram draft found).
    `verification_width`: every round verifies that many tokens (compiled verification pads to one shape),
    so the budget weighs only the drafter's pass (`CostModel.at_fixed_verification`)."""
    policy = sizing_its_own_drafts(block_size_policy(drafter, unset="adaptive"))
    max_block_size = drafter.config.block_size
    if isinstance(policy, AdaptiveBlockSize):
        cost_model = policy.cost_model
        if cost_model is None:
            cost_model = measured_cost_model(target, drafter, (1,), policy.cache_dir, verification=True)
        if verification_width is None:
            return TreeBudget(max_block_size, max_ngram_tokens, one_branch, policy, cost_model=cost_model)
        fixed = cost_model.at_fixed_verification(verification_width)
        return TreeBudget(max_block_size, max_ngram_tokens, one_branch, policy, cost_model=fixed, measured=cost_model)
    block = block_size_controller(drafter, target, batch_size=1)  # a fixed k or a schedule; bad ones raise
    return TreeBudget(max_block_size, max_ngram_tokens, one_branch, AdaptiveBlockSize(), block=block)
