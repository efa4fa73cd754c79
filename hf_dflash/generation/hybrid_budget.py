"""Hybrid drafting: a DFlash block and a prompt-lookup (n-gram) continuation verified as one draft tree.

With `prompt_lookup_num_tokens` beside a DFlash assistant (batch size 1), each round drafts the block and
looks up an n-gram continuation of the committed tokens; the two branches are merged into a trie
(`tree.merge_branches`: a shared prefix is verified once) and verified in ONE target forward (greedy), or
the better branch is chosen before verification (sampling, or a target that cannot take a tree mask).
How many drafts each branch offers is the `TreeBudget`'s choice, from running acceptance estimates and
(adaptive policy) the measured cost of the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache, StaticLayer

from ..modeling_dflash import DFlashDraftModel
from .adaptive import (
    POLICY_ATTRIBUTE,
    AdaptiveBlockSize,
    BlockSizeController,
    acceptance_probabilities,
    block_size_controller,
    expected_tokens,
    update_acceptance_counts,
)
from .cost_model import CostModel
from .cost_timing import measured_cost_model
from .drafting import Drafts
from .ngram import DEFAULT_MAX_NGRAM_SIZE, MATCH_BUCKETS, PromptLookup, match_bucket
from .stats import AcceptanceStats
from .tree import DraftTree, accepted_path, merge_branches, tree_depths
from .verification import accepted_lengths

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
        self.ngram_estimates = [
            BranchEstimate(self.max_ngram_tokens, self.settings, chained=False) for _ in MATCH_BUCKETS
        ]
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
    drafter: DFlashDraftModel,
    target: PreTrainedModel,
    max_ngram_tokens: int,
    one_branch: bool,
    verification_width: int | None = None,
) -> TreeBudget:
    """The budget of one hybrid `generate` call from `drafter.block_size_policy`: None or "adaptive" (the
    default here: the cost model measured once per pair and machine, verification passes included), an
    `AdaptiveBlockSize`, a fixed k or a schedule (tree = that block + every n-gram draft found).
    `verification_width`: every round verifies that many tokens (compiled verification pads to one shape),
    so the budget weighs only the drafter's pass (`CostModel.at_fixed_verification`)."""
    policy = getattr(drafter, POLICY_ATTRIBUTE, None)
    if policy is None or (isinstance(policy, str) and policy == "adaptive"):
        policy = AdaptiveBlockSize()
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


def verifies_trees(model: PreTrainedModel, cache, max_length: int, max_nodes: int) -> bool:
    """Whether the target can verify a draft tree in one forward: an attention that takes our 4D mask
    (eager, SDPA) and a DynamicCache whose layers are full attention, or sliding windows that generation
    cannot reach (the tree mask does not encode a window), or a StaticCache of full-attention layers with
    room for a whole tree after `max_length` tokens (the mask then spans all its slots)."""
    if model.config._attn_implementation not in ("eager", "sdpa") or type(cache) not in (DynamicCache, StaticCache):
        return False
    reachable = max_length + max_nodes
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window <= reachable:
            return False
        if type(layer) is StaticLayer and layer.max_cache_len < reachable:
            return False
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer):
            return False
    return True


class HybridDrafting:
    """The n-gram branch of a hybrid round and the tree that joins it to the block (batch size 1).

    Each round: `plan` looks up the n-gram continuation and asks the budget for (k, m); the loop drafts
    the block (k > 1); `candidates` merges the branches into the round's draft; after verification
    `observe` records the round and teaches the budget which branch was right.
    """

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: PreTrainedModel,
        generation_config,
        cache,
        verification_width: int | None = None,
    ):
        max_ngram_size = generation_config.max_matching_ngram_size
        self.prompt_lookup = PromptLookup(
            generation_config.prompt_lookup_num_tokens,
            DEFAULT_MAX_NGRAM_SIZE if max_ngram_size is None else max_ngram_size,
        )
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        max_nodes = drafter.config.block_size + self.prompt_lookup.num_tokens
        one_branch = self.do_sample or not verifies_trees(target, cache, self.max_length, max_nodes)
        self.budget = tree_budget(drafter, target, self.prompt_lookup.num_tokens, one_branch, verification_width)
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.ngram_found: torch.LongTensor | None = None  # the n-gram continuation found this round
        self.tree: DraftTree | None = None  # the round's draft as a tree (a chain unless both branches drafted)
        self.block_tree: DraftTree | None = None  # the block's part of it: its chain, or the drafter's tree

    def plan(self, sequence: torch.LongTensor, block_allowed: bool = True) -> tuple[int, torch.LongTensor]:
        """The block length k and the n-gram drafts (m,) of the round after the committed `sequence` (L,);
        k = 1 when the block is not allowed (the prefill: the drafter has no context features yet)."""
        self.ngram_found, match_length = self.prompt_lookup.draft(sequence, self.max_length - len(sequence) - 1)
        block_length, num_ngram = self.budget.choose(len(self.ngram_found), block_allowed, match_length)
        return block_length, self.ngram_found[:num_ngram]

    def candidates(
        self, root: int, block: Drafts, ngram: torch.LongTensor, block_tree: DraftTree | None = None
    ) -> Drafts:
        """The round's draft from the block's drafts (1, d) and the n-gram drafts (m,): the block alone, the
        n-gram chain alone (with one-hot draft probabilities when sampling: rejection sampling then accepts
        a draft with probability p(draft)), or both as `self.tree`'s nodes 1..N-1 (greedy only). With a
        drafter tree (`block_tree`, its nodes 1..N-1 the block's drafts) the n-gram chain is grafted onto it."""
        self.block_tree = block_tree if block_tree is not None else merge_branches(root, [block.tokens[0]])
        self.tree = merge_branches(root, [ngram], base=self.block_tree)
        if not len(ngram):
            return block
        if not block.tokens.shape[1]:
            one_hot = torch.nn.functional.one_hot(ngram, self.vocab_size).float()[None] if self.do_sample else None
            return Drafts(ngram[None], one_hot)
        if self.do_sample:
            raise RuntimeError("Sampling verifies one branch: the tree budget must not choose both.")
        return Drafts(self.tree.tokens[None, 1:])

    def observe(self, committed: torch.LongTensor, stats: AcceptanceStats) -> None:
        """committed (c,): the round's committed tokens, its accepted drafts first (c - 1 of them)."""
        num_matches = len(committed) - 1
        stats.tree_sizes.append(self.tree.num_nodes)
        stats.block_tokens.append(len(accepted_path(self.block_tree, committed[:num_matches])) - 1)
        stats.ngram_tokens.append(agreement(self.tree.tokens[list(self.tree.branches[-1])], committed[:num_matches]))
        # Each branch's drafts against the committed tokens, bonus included: for the n-gram branch also
        # the drafts found but left out of the tree (whether the target would have accepted them).
        block_depth = int(tree_depths(self.block_tree.parents).max())
        block_compared, ngram_compared = min(block_depth, len(committed)), min(len(self.ngram_found), len(committed))
        block_agreed = len(accepted_path(self.block_tree, committed)) - 1
        self.budget.observe(block_compared, block_agreed, ngram_compared, agreement(self.ngram_found, committed))


def agreement(drafts: torch.LongTensor, committed: torch.LongTensor) -> int:
    """Length of the common prefix of drafts (d,) and committed (c,): the drafts the target accepted."""
    length = min(len(drafts), len(committed))
    return int(accepted_lengths(drafts[None, :length], committed[None, :length])[0])
