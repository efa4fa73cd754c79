"""DFlash2's candidate selector, for the decoding loop: the block's drafts from one drafter pass.

The maths lives in the remote-code file (`modeling_dflash.selector_walk`, `unary_top_k`), so a Hub user's
`custom_generate` loop and this package walk the same way; this module puts the steps together:
drafter outputs -> logits (with the drafter's transforms, then the call's logits processors) -> top-K
candidates per slot -> the walk. Greedy with the selector at identity (hidden projection 0) gives each slot's
argmax: DFlash's greedy chain.

Sampling walks with slot l drawn from softmax(S_l / T) over its K candidates (T the call's temperature;
the processed unary logits already carry it, so the pair term is divided by T). The draft distribution q of
slot l is that softmax given the predecessor actually drawn, scattered over the vocabulary (0 outside the
candidates): exactly what the slot was drawn from, so the rejection test (p - q residual) stays lossless.
"""

from __future__ import annotations

import torch
from torch import nn

from ...modeling_dflash import DFlashDraftModel
from ...modeling_dflash.custom_generate import sampled_choice, sampling_temperature
from ...modeling_dflash.modeling_dflash import SelectorPath, greedy_choice, selector_walk, unary_top_k


def selector_chain(
    drafter: DFlashDraftModel,
    hidden: torch.Tensor,
    lm_head: nn.Module,
    anchor_ids: torch.LongTensor,
    choose=greedy_choice,
) -> SelectorPath:
    """The selector's walk over one block per row, from the drafter's raw draft logits.

    hidden (B, L, H) the drafter's outputs for the L draft slots (slot 0, the anchor, excluded);
    anchor_ids (B,) the anchor (bonus) token of each row; `choose` maps (B, K) scores to indices (default:
    greedy). Returns tokens (B, L), choices (B, L) and the score rows (B, L, K) the choices were made from.

    Raises:
        ValueError: the drafter is not DFlash2.
    """
    selector = drafter.candidate_selector
    if selector is None:
        raise ValueError("selector_chain needs a DFlash2 drafter (config.is_dflash2); this one is DFlash.")
    return selector.walk(hidden, drafter.draft_logits(hidden, lm_head), anchor_ids, choose)[0]


def selector_drafts(
    drafter: DFlashDraftModel,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.LongTensor,
    do_sample: bool,
    logits_processor=None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """A round's drafts by the selector: (tokens (B, L), scores (B, L, V)) from the drafter's outputs hidden
    (B, L, H) and their processed draft logits (B, L, V).

    Greedy: the walk's argmax path; scores are each slot's S over its candidates (-inf elsewhere), so their
    argmax is the draft. Sampling: each slot drawn from softmax(S / T) given the predecessor drawn; scores
    are those distributions (0 outside the candidates), the q of the rejection test.
    """
    temperature = sampling_temperature(logits_processor) if do_sample else 1.0
    choose = sampled_choice if do_sample else greedy_choice
    path, candidate_ids = drafter.candidate_selector.walk(hidden, logits, anchor_ids, choose, temperature)
    scores = torch.full(logits.shape, float("-inf"), device=logits.device).scatter(-1, candidate_ids, path.scores)
    return path.tokens, scores.softmax(-1) if do_sample else scores


def selector_tree_children(
    drafter: DFlashDraftModel, hidden: torch.Tensor, logits: torch.Tensor, token_ids=None, temperature: float = 1.0
):
    """`tree.Children` of one block: slot l's K candidates (the top-K of its draft logits) after a node holding
    token t, ranked by log softmax(S_l | t) with S_l[k] = unary + < A[t] * P_l, B[candidate k] > as the walk
    scores them (pair term / `temperature`). hidden (L, H) and logits (L, V') of the block's L draft slots;
    token_ids (V',) the target ids of a pruned draft vocabulary's columns (None: V' is the vocabulary). The
    best child of every node is the greedy walk's choice after it."""
    selector = drafter.candidate_selector
    candidate_ids, unary = unary_top_k(logits.float(), selector.top_k)  # (L, K)
    if token_ids is not None:
        candidate_ids = token_ids.to(candidate_ids.device)[candidate_ids]
    weight = selector.hidden_projection.weight
    projected = selector.hidden_projection(hidden.to(weight.dtype)).float() / temperature  # (L, r)
    successors = selector.successor_codebook[candidate_ids].float()  # (L, K, r)
    offered = {}

    def children(token: int, slot: int) -> tuple[list[float], list[int]]:
        if (token, slot) not in offered:
            context = selector.predecessor_codebook[token].float() * projected[slot]  # (r,)
            scores = unary[slot] + successors[slot] @ context
            log_probs, order = scores.log_softmax(-1).sort(descending=True, stable=True)
            offered[token, slot] = log_probs.tolist(), candidate_ids[slot, order].tolist()
        return offered[token, slot]

    return children


__all__ = [
    "SelectorPath",
    "greedy_choice",
    "sampled_choice",
    "sampling_temperature",
    "selector_chain",
    "selector_drafts",
    "selector_tree_children",
    "selector_walk",
    "unary_top_k",
]
