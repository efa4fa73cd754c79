"""The drafter side of DFlash decoding: one drafter pass drafts a block for every row.

`BlockDrafter` keeps the drafter's context cache (the fused target features of the committed tokens,
as keys/values of every draft layer) and a (B, T) validity mask of its slots: rows of a batch accept
different numbers of drafts, so their context grows by different amounts each round, and the slots a
row did not fill are holes, masked exactly like left padding. With one row every slot is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..caches import compact_cache, needs_compaction
from ..modeling_dflash import DFlashDraftModel
from .verification import greedy_tokens, process_draft_rows


@dataclass
class Drafts:
    """A round's drafted tokens (B, d) and, when sampling, the distributions they were drawn from (B, d, V);
    when greedy with logits processors, `scores` holds the processed draft logits (None otherwise)."""

    tokens: torch.LongTensor
    scores: torch.Tensor | None = None


class BlockDrafter:
    """Drafts `[bonus, MASK x (k - 1)]` blocks for B rows in one drafter pass per round."""

    def __init__(self, drafter: DFlashDraftModel, target: PreTrainedModel):
        self.drafter = drafter
        self.embedding = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.mask_token_id = drafter.config.mask_token_id
        self.cache = DynamicCache(config=drafter.config)
        self.mask: torch.Tensor | None = None  # (B, T) validity of the cached context slots

    def draft_hidden(
        self, bonus: torch.LongTensor, context: torch.Tensor, context_mask: torch.Tensor, block_length: int
    ) -> torch.Tensor:
        """One drafter pass over `[bonus, MASK x (block_length - 1)]` after the new context.

        bonus (B,) each row's last committed token; context (B, C, n*Ht) target features of the tokens
        committed since the last pass, valid where context_mask (B, C) is 1. Each row's positions count
        its valid slots only. Returns the (B, block_length - 1, H) outputs of the mask slots.
        """
        batch, device = bonus.shape[0], bonus.device
        past_mask = self.mask if self.mask is not None else context_mask[:, :0]
        seen = past_mask.sum(1, keepdim=True)  # (B, 1) tokens whose features are already cached
        context_positions = (seen + context_mask.cumsum(1) - 1).clamp_min(0)
        bonus_position = seen + context_mask.sum(1, keepdim=True)  # = tokens before the bonus
        block_positions = bonus_position + torch.arange(block_length, device=device)
        block_ids = torch.full((batch, block_length), self.mask_token_id, dtype=bonus.dtype, device=device)
        block_ids[:, 0] = bonus
        self.mask = torch.cat([past_mask, context_mask], 1)
        hidden = self.drafter(
            noise_embeds=self.embedding(block_ids),
            context_hidden_states=context,
            position_ids=torch.cat([context_positions, block_positions], 1),
            attention_mask=torch.cat([self.mask, self.mask.new_ones(batch, block_length)], 1),
            cache=self.cache,
        ).last_hidden_state
        self.cache.crop(-block_length)  # keep the context only; the next block replaces this one
        return hidden[:, 1:]

    def draft(
        self,
        hidden: torch.Tensor,
        do_sample: bool,
        logits_processor=None,
        batch_size: int = 1,
        rows: list[int] | None = None,
        prefixes: list[torch.LongTensor] | None = None,
    ) -> Drafts:
        """Draft tokens from the drafter outputs (B, d, H) of `draft_hidden`.

        Greedy without logits processors: the argmax, without full-vocabulary logits (a pruned draft
        vocabulary scores only its own ids). Otherwise the draft logits are processed (every position with
        the row's committed prefix, `process_draft_rows`) and drafts are their argmax, or samples when
        `do_sample`. rows/prefixes/batch_size: as `process_draft_rows` needs them.
        """
        if not do_sample and not logits_processor:
            return Drafts(self.drafter.greedy_draft_tokens(hidden, self.lm_head))
        logits = self.drafter.draft_logits(hidden, self.lm_head)  # (B, d, V)
        logits = process_draft_rows(logits_processor, batch_size, rows or [0], prefixes, logits)
        if not do_sample:
            return Drafts(greedy_tokens(logits), logits)
        probs = logits.softmax(-1)
        tokens = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
        return Drafts(tokens, probs)

    def tree_logits(
        self, hidden: torch.Tensor, logits_processor=None, batch_size: int = 1, rows=None, prefixes=None
    ) -> tuple[torch.Tensor, torch.LongTensor | None]:
        """Draft logits (B, d, V') of `draft_hidden`'s outputs for building a tree, and the target ids of their
        V' columns (None: V' is the target vocabulary). Without logits processors a pruned draft vocabulary
        scores only its own ids; with them, full-vocabulary logits are processed as `draft` processes them."""
        if not logits_processor:
            return self.drafter.draft_logits(hidden, self.lm_head, full_vocab=False), self.drafter.draft_token_ids
        logits = self.drafter.draft_logits(hidden, self.lm_head)
        return process_draft_rows(logits_processor, batch_size, rows or [0], prefixes, logits), None

    def prune(self, index: torch.LongTensor | None) -> None:
        """Keep the rows `index` (B',) (None: all) and compact the cache when its holes exceed the bound."""
        if self.mask is None:
            return
        if index is not None:
            self.cache.batch_select_indices(index)
            self.mask = self.mask[index]
        if needs_compaction(self.mask):
            self.mask = compact_cache(self.cache, self.mask)
