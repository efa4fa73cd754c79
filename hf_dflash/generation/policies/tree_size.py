"""Draft trees from the drafter's own distribution: more tokens per round from the same drafter pass.

The drafter scores every vocabulary entry at every slot of its block in one pass; a chain keeps the argmax
of each slot. A draft tree keeps the most probable continuations instead (`drafting/draft_tree.py`:
`best_first_tree`, as DDTree does): the target verifies all of them in one forward (tree mask, positions by
depth) and keeps the longest one it agrees with, so greedy output stays token-identical; sampling walks the tree
by sampling the target's own token at each node (`verifying/tree_verification.py`: `sampled_tree_path`), so the
output is distributed as the target's.

Opt in on the drafter (batch size 1; larger batches draft chains):

    drafter.draft_tree = "auto"   # the tree size that maximises expected tokens per second, each round
    drafter.draft_tree = 32       # always (up to) 32 nodes, root included
    drafter.draft_tree = None     # default: the chain

"auto" weighs each node's chance of being accepted (its path probability under the drafter, calibrated
by the acceptance seen so far) against the measured cost of verifying one more node (`cost_timing.py`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ...modeling_dflash import DFlashDraftModel
from ..drafting.draft_tree import Children, DraftTree, best_first_tree, best_first_tree_by
from .confidence import DraftCalibration
from .cost_model import CostModel
from .cost_timing import measured_cost_model

TREE_ATTRIBUTE = "draft_tree"  # the drafter attribute `generate` reads
# Under compiled verification "auto" chooses one tree size at the first tree of the first call and keeps it
# here, on the drafter: later compiled calls reuse it, so one graph serves them all (delete it to choose again).
COMPILED_SIZE_ATTRIBUTE = "compiled_draft_tree"
AUTO_MAX_NODES = 64  # the largest tree "auto" considers
# The largest tree any setting verifies: its forward reads every node and its mask has nodes x (context + nodes)
# entries; trees past ~64 nodes already cost more than they win on the machines measured (docs/results-history.md).
MAX_TREE_NODES = 512
DEFAULT_TOP_K = 16  # candidates per slot (DFlash2: the target's token is in the drafter's top-16 99.5% of the time)


def best_tree_size(reach: torch.Tensor, seconds: torch.Tensor, calibration: float = 1.0, min_nodes: int = 1) -> int:
    """The node count n (min_nodes <= n, or all N nodes when fewer) that maximises expected committed tokens
    per second.

    reach (N,): log-probability of reaching each node of a best-first tree (root 0, then decreasing);
    seconds (>= N,): seconds of a round with n = 1.. nodes. A round commits 1 + the accepted drafts, in
    expectation 1 + calibration * sum of the first n - 1 nodes' probabilities. The smallest n on ties.
    """
    gain = torch.cumsum(reach.exp().to(torch.float64), 0) - 1  # (N,) expected accepted drafts of n nodes
    rate = (1 + calibration * gain) / seconds[: len(reach)].to(torch.float64)
    smallest = min(min_nodes, len(reach))
    return int(rate[smallest - 1 :].argmax()) + smallest


@dataclass
class TreeDrafting:
    """Builds each round's tree (at most `max_nodes` nodes, `top_k` candidates per slot) and, with a cost
    curve (`seconds`: round seconds per node count), chooses its size; learns how far to trust the drafter's
    probabilities from the acceptance it observes.

    `one_size` (compiled verification reads one width per call): the first tree's size, chosen on the cost
    curve among n >= `min_nodes`, becomes `max_nodes` and every later tree has that many nodes (`choosing_size` until then)."""

    max_nodes: int
    top_k: int = DEFAULT_TOP_K
    seconds: torch.Tensor | None = None  # (max_nodes,) seconds of a round with n nodes; None: always max_nodes
    min_nodes: int = 1  # the smallest size the cost curve may choose
    one_size: bool = False
    trust: DraftCalibration = field(default_factory=DraftCalibration, init=False)  # of the drafter's probabilities

    def __post_init__(self):
        if self.max_nodes < 2 or self.top_k < 1:
            raise ValueError(f"A draft tree needs max_nodes >= 2 and top_k >= 1, got {self.max_nodes}, {self.top_k}.")
        if self.max_nodes > MAX_TREE_NODES:
            raise ValueError(
                f"TreeDrafting(max_nodes={self.max_nodes}): a draft tree verifies at most {MAX_TREE_NODES} nodes in one "
                "target forward; choose fewer (or draft_tree='auto')."
            )
        if self.one_size and self.seconds is None:
            raise ValueError("TreeDrafting(one_size=True) chooses its size on a cost curve: give seconds=.")

    @property
    def choosing_size(self) -> bool:
        """A one-size tree whose first tree, which chooses the size of all, is still to come."""
        return self.one_size and self.seconds is not None

    @property
    def calibration(self) -> float:
        """Observed / predicted accepted drafts, shrunk toward 1 by one round's worth of prior."""
        return self.trust.factor

    def build(self, root: int, logits: torch.Tensor, token_ids: torch.LongTensor | None) -> DraftTree:
        """The tree after `root` from the draft logits (L, V') of the block's L draft slots; token_ids (V',) maps
        a pruned draft vocabulary to target ids (None: V' is the target vocabulary)."""
        log_probs, ranked = logits.float().log_softmax(-1).topk(min(self.top_k, logits.shape[-1]), dim=-1)
        if token_ids is not None:
            ranked = token_ids.to(ranked.device)[ranked]
        return self.sized(*best_first_tree(root, ranked, log_probs, self.max_nodes))

    def build_by(self, root: int, length: int, children: Children) -> DraftTree:
        """The tree after `root` over `length` draft slots whose candidates depend on the parent token
        (`drafting/draft_tree.py:best_first_tree_by`; DFlash2's selector)."""
        return self.sized(*best_first_tree_by(root, length, children, self.max_nodes))

    def sized(self, tree: DraftTree, reach: torch.Tensor) -> DraftTree:
        """The first nodes of a best-first tree with reach (N,) log-probabilities: as many as the cost curve
        chooses (all without one)."""
        size = tree.num_nodes
        if self.seconds is not None:
            size = best_tree_size(reach, self.seconds, self.calibration, self.min_nodes)
        if self.choosing_size:
            self.max_nodes, self.seconds = size, None
        tree = DraftTree(tree.tokens[:size], tree.parents[:size], ())
        self.trust.expected = float(reach[1:size].exp().sum())
        return tree

    def observe(self, accepted_drafts: int) -> None:
        """The last tree's round accepted this many drafts."""
        self.trust.observe(accepted_drafts)


def auto_tree_drafting(cost: CostModel, block_size: int, one_size: bool = False) -> TreeDrafting:
    """Trees of up to `AUTO_MAX_NODES` nodes sized by `cost` (batch 1): a round of n nodes costs the drafter's
    pass at the trained block (`CostModel.drafter_seconds`) + the verification of n. Each round, or with
    `one_size` (compiled verification) once, at the first tree, never below the trained block B."""
    verify = cost.verification_seconds_per_length(1, AUTO_MAX_NODES)
    seconds = cost.drafter_seconds(1, block_size)[-1] + verify
    if one_size:
        return TreeDrafting(AUTO_MAX_NODES, seconds=seconds, min_nodes=block_size, one_size=True)
    return TreeDrafting(AUTO_MAX_NODES, seconds=seconds)


def tree_drafting(
    drafter: DFlashDraftModel, target: PreTrainedModel, fixed_verification: bool = False
) -> TreeDrafting | None:
    """The tree setting of one `generate` call from `drafter.draft_tree`: None (chains), an int N >= 2 (trees
    of up to N nodes), "auto" (up to `AUTO_MAX_NODES`, sized by the measured cost curve), or a
    `TreeDrafting`. Anything else raises ValueError. `fixed_verification`: every round verifies the largest
    tree's node count (compiled verification pads to one shape), so "auto" chooses one size, at the first tree
    of the first such call (`TreeDrafting.one_size`), and later calls reuse it (`remember_compiled_size`)."""
    setting = getattr(drafter, TREE_ATTRIBUTE, None)
    if setting is None or isinstance(setting, TreeDrafting):
        return setting
    if isinstance(setting, str) and setting == "auto":
        chosen = getattr(drafter, COMPILED_SIZE_ATTRIBUTE, None) if fixed_verification else None
        if chosen is not None:
            return TreeDrafting(chosen)
        cost = measured_cost_model(target, drafter, (1,), verification=True, max_verified_tokens=AUTO_MAX_NODES)
        return auto_tree_drafting(cost, drafter.config.block_size, one_size=fixed_verification)
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 2:
        return TreeDrafting(bounded_tree_size(setting, drafter.config.block_size))
    raise ValueError(
        f"drafter.draft_tree = {setting!r} is not a tree setting. Use None (chains), 'auto' (sized by the measured "
        "cost of verification), an int N >= 2 (trees of up to N nodes, root included), or a TreeDrafting(...)."
    )


def bounded_tree_size(nodes: int, block_size: int, top_k: int = DEFAULT_TOP_K) -> int:
    """`nodes`, or the most a tree can hold when that is fewer (with a warning, before anything is allocated): the
    tree of every top-k continuation of the block's block_size - 1 slots, and `MAX_TREE_NODES`."""
    reachable, level = 1, 1
    for _ in range(block_size - 1):
        level *= top_k
        reachable += level
        if reachable >= MAX_TREE_NODES:
            break
    bound = min(reachable, MAX_TREE_NODES)
    if nodes > bound:
        warnings.warn(
            f"drafter.draft_tree = {nodes}: a tree of this drafter (block {block_size}, {top_k} candidates per slot) "
            f"verified in one forward holds at most {bound} nodes; drafting trees of {bound}.",
            stacklevel=4,
        )
    return min(nodes, bound)


def remember_compiled_size(drafter: DFlashDraftModel, trees: TreeDrafting) -> None:
    """A one-size tree of `draft_tree="auto"` just chose its size: later compiled calls reuse it (each new
    size would compile a new graph)."""
    if getattr(drafter, TREE_ATTRIBUTE, None) == "auto":
        setattr(drafter, COMPILED_SIZE_ATTRIBUTE, trees.max_nodes)
