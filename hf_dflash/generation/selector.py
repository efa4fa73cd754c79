"""DFlash2's candidate selector, for the decoding loop: the block's chain from one drafter pass.

The maths lives in the remote-code file (`modeling_dflash.selector_walk`, `unary_top_k`), so a Hub user's
`custom_generate` loop and this package walk the same way; this module puts the steps together:
drafter outputs -> logits (with the drafter's transforms) -> top-K candidates per slot -> the walk.
Greedy with the selector at identity (hidden projection 0) gives each slot's argmax: DFlash's greedy chain.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modeling_dflash import DFlashDraftModel
from ..modeling_dflash.modeling_dflash import SelectorPath, greedy_choice, selector_walk, unary_top_k


def selector_chain(
    drafter: DFlashDraftModel,
    hidden: torch.Tensor,
    lm_head: nn.Module,
    anchor_ids: torch.LongTensor,
    choose=greedy_choice,
) -> SelectorPath:
    """The selector's walk over one block per row.

    hidden (B, L, H) the drafter's outputs for the L draft slots (slot 0, the anchor, excluded);
    anchor_ids (B,) the anchor (bonus) token of each row; `choose` maps (B, K) scores to indices (default:
    greedy). Returns tokens (B, L), choices (B, L) and the score rows (B, L, K) the choices were made from.

    Raises:
        ValueError: the drafter is not DFlash2.
    """
    selector = drafter.candidate_selector
    if selector is None:
        raise ValueError("selector_chain needs a DFlash2 drafter (config.is_dflash2); this one is DFlash.")
    candidate_ids, unary = unary_top_k(drafter.draft_logits(hidden, lm_head).float(), selector.top_k)
    return selector.walk(hidden, candidate_ids, unary, anchor_ids, choose)


__all__ = ["SelectorPath", "greedy_choice", "selector_chain", "selector_walk", "unary_top_k"]
