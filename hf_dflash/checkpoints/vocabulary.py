"""Expanding a pruned draft vocabulary to the target's whole vocabulary, for engines that cannot take a pruned one.

What in a drafter depends on its draft vocabulary (`draft_vocab_size` N < the target's V):
- the head: the drafter has none of its own; it scores with the target head's N rows at the draft ids
  (`draft_head`), and an official export stores those rows as `lm_head.weight` (N, H);
- `d2t` (N,) / `t2d` (V,): which target ids the N rows are;
- DFlash2's candidate selector: its top-K candidates are the K best of those N logits; its codebooks are already
  (V, r), indexed by target id (any anchor has a predecessor row), and its hidden projection does not see ids.
Expanding drops `d2t`/`t2d` and sets `draft_vocab_size` None: the drafter scores with the target's whole head, every
weight stays as trained, and the logits of the draft ids are exactly the pruned drafter's. The drafts can change:
an id outside the N can now win a slot's argmax, and DFlash2's selector ranks its top-K over all V ids.
"""

from __future__ import annotations

from ..modeling_dflash import DFlashDraftModel
from .building import build_drafter

DRAFT_VOCAB_BUFFERS = ("d2t", "t2d")


def expand_draft_vocabulary(model: DFlashDraftModel) -> DFlashDraftModel:
    """A new drafter (same dtype and device, eval mode) that drafts over the target's whole vocabulary with the
    weights of `model`, whose draft vocabulary is pruned (`draft_vocab_size` set).

    Its logits at the draft ids equal `model`'s; elsewhere they are the target head's where `model` had -inf, so its
    greedy drafts (and DFlash2's selector candidates, its top-K over all ids) may differ from `model`'s.

    Raises:
        ValueError: `model` already drafts over the whole vocabulary.
    """
    config = model.config
    if config.draft_vocab_size is None:
        raise ValueError(
            "This drafter has draft_vocab_size=None: it already drafts over the target's whole vocabulary "
            "(nothing to expand); drop --expand-vocabulary (expand_vocabulary=False)."
        )
    kwargs = {key: getattr(config, key) for key in type(config).__annotations__ if hasattr(config, key)}
    kwargs["draft_vocab_size"] = None
    state_dict = {key: value for key, value in model.state_dict().items() if key not in DRAFT_VOCAB_BUFFERS}
    parameter = next(model.parameters())
    return build_drafter(kwargs, state_dict, "the expanded drafter", dtype=parameter.dtype, device=parameter.device)


__all__ = ["DRAFT_VOCAB_BUFFERS", "expand_draft_vocabulary"]
