"""Drafting strategies: where each round's drafts come from. `drafting_strategy` chooses one per `generate` call
from the drafter's settings and the generation config; a new strategy is one file here and one line there."""

from __future__ import annotations

import warnings

from ....modeling_dflash import DFlashDraftModel
from ...options import verifies_trees
from ...policies.block_size import block_size_controller
from ...policies.tree_size import TreeDrafting, tree_drafting
from ..block_drafter import BlockDrafter
from .base import DraftStrategy, Proposal
from .chain import ChainDrafting
from .drafter_tree import DrafterTreeDrafting
from .hybrid import HybridDrafting

__all__ = ["ChainDrafting", "DraftStrategy", "DrafterTreeDrafting", "HybridDrafting", "Proposal", "drafting_strategy"]


def drafting_strategy(
    drafter: DFlashDraftModel, target, generation_config, logits_processor, cache, batch_size: int, fixed_width: bool
) -> DraftStrategy:
    """The strategy of one `generate` call: chains (`drafter.block_size_policy`), drafter trees (`drafter.draft_tree`,
    batch 1) and hybrid drafting (`prompt_lookup_num_tokens`, batch 1) around either. `fixed_width`: every round
    verifies one width (compiled verification), so the policies weigh the drafter's pass only."""
    block = BlockDrafter(drafter, target)
    do_sample = bool(generation_config.do_sample)
    ngram = generation_config.prompt_lookup_num_tokens
    hybrid = ngram is not None
    trees = tree_drafting(drafter, target, fixed_width)
    trees = verifiable_trees(trees, target, cache, generation_config.max_length, batch_size)
    controller = None if hybrid else block_size_controller(drafter, target, batch_size, fixed_width, trees is not None)
    if trees is None:
        strategy = ChainDrafting(block, controller, do_sample, logits_processor)
    else:
        strategy = DrafterTreeDrafting(block, controller, do_sample, logits_processor, trees)
    if hybrid:
        max_nodes = strategy.width() + ngram
        one_branch = not verifies_trees(target, cache, generation_config.max_length, max_nodes)
        strategy = HybridDrafting(strategy, target, generation_config, one_branch, fixed_width)
    return strategy


def verifiable_trees(trees: TreeDrafting | None, target, cache, max_length: int, batch_size: int):
    """`trees` where this call can verify them, else None (chains) with a warning saying why."""
    if trees is None:
        return None
    if batch_size > 1:  # one tree per row would need a mask per row: larger batches draft chains
        warnings.warn(
            f"drafter.draft_tree serves batch size 1; this batch of {batch_size} drafts chains.", stacklevel=4
        )
        return None
    if not verifies_trees(target, cache, max_length, trees.max_nodes):
        warnings.warn(
            "This target cannot verify a draft tree in one forward (attention other than eager/SDPA, "
            "a cache other than DynamicCache/StaticCache, a sliding window generation can reach, or a "
            f"static cache without {trees.max_nodes} slots beyond max_length): drafting chains.",
            stacklevel=4,
        )
        return None
    return trees
