"""The drafter side of DFlash decoding: one drafter pass drafts a block for every row.

`BlockDrafter` keeps the drafter's context cache (the fused target features of the committed tokens,
as keys/values of every draft layer), a (B, T) validity mask of its slots, and the features the target
produced since the last pass (pending, read by the next one). Rows of a batch accept different numbers of
drafts, so their context grows by different amounts each round, and the slots a row did not fill are
holes, masked exactly like left padding. With one row every slot is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import TemperatureLogitsWarper

from ...caches import compact_cache, needs_compaction
from ...modeling_dflash import DFlashDraftModel
from ...modeling_dflash.custom_generate import drafter_cache, drafter_pass
from ..verifying.acceptance_rules import greedy_tokens, process_draft_rows
from .selector import selector_drafts


@dataclass
class Drafts:
    """A round's drafted tokens (B, d) and, when sampling, the distributions they were drawn from (B, d, V);
    when greedy with logits processors, `scores` holds the processed draft logits, or with a DFlash2 selector
    each slot's selector scores over its candidates (-inf elsewhere); None otherwise. `probabilities` (B, d), when
    asked for: the drafter's probability of each draft (DFlash2: its selector's, given the draft before it)."""

    tokens: torch.LongTensor
    scores: torch.Tensor | None = None
    probabilities: torch.Tensor | None = None

    def prefix(self, length: int) -> Drafts:
        """The first `length` drafts of every row."""
        return Drafts(*(None if x is None else x[:, :length] for x in (self.tokens, self.scores, self.probabilities)))


def probability_of(scores: torch.Tensor, chosen: torch.LongTensor, normalised: bool = False) -> torch.Tensor:
    """(..., d) the probability of each chosen index (..., d) under scores (..., d, N): logits softmaxed, or
    distributions already (`normalised`)."""
    distributions = scores if normalised else scores.float().softmax(-1)
    return distributions.gather(-1, chosen[..., None])[..., 0]


def agreement_probability(distributions: torch.Tensor) -> torch.Tensor:
    """(..., d) sum_v q_v^2 of distributions q (..., d, N): the chance that two draws from q agree, q(x) averaged
    over the draws x ~ q. The price of a sampled draft, whose acceptance min(1, p(x) / q(x)) is unknown before the
    target verifies it: the draw's own q(x) carries the draw's noise and chose worse prefixes on held-out chats of
    the target's samples (SmolLM2 v7 candidate, T = 0.7 / 1.0: 1.6% / 3.1% fewer modelled tokens per second; on
    greedy text the two are within 1.6% either way; benchmarks/generation/sampling_confidence.py)."""
    return distributions.float().square().sum(-1)


def draft_temperature(drafter: DFlashDraftModel) -> float | None:
    """`drafter.draft_temperature`: None (default) drafts at the call's own temperature; T' >= 0 drafts from the
    drafter's distribution at T' instead (0: its argmax), when `generate` samples. Any draft distribution keeps the
    output the target's (rejection sampling divides by the q the drafts came from); acceptance is sum min(p, q), so
    a drafter less sure than the target drafts better cooler. Greedy decoding ignores it."""
    value = getattr(drafter, "draft_temperature", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
        raise ValueError(
            f"drafter.draft_temperature={value!r}: None (the call's temperature) or a finite number >= 0 (0: argmax)."
        )
    return float(value)


def at_temperature(logits_processor, temperature: float) -> LogitsProcessorList:
    """The call's logits processors with its temperature warper at `temperature` (one is added first when it has
    none), the other warpers (top-k, top-p, ...) kept in their order."""
    warper, processors = TemperatureLogitsWarper(temperature), list(logits_processor or ())
    if not any(isinstance(p, TemperatureLogitsWarper) for p in processors):
        return LogitsProcessorList([warper, *processors])
    return LogitsProcessorList([warper if isinstance(p, TemperatureLogitsWarper) else p for p in processors])


def context_cache(config, rows: int) -> DynamicCache:
    """The drafter's context cache for `rows` rows. One row: `drafter_cache`, whose sliding-window layers keep
    their window of slots and roll the block back. Several rows: every layer keeps all its slots, since a batch's
    slots have holes (padding, rejected drafts) and a sliding layer that evicts by slot count would drop keys still
    inside the window; the drafter's mask applies each window in token positions instead."""
    return drafter_cache(config) if rows == 1 else DynamicCache()


class BlockDrafter:
    """Drafts `[bonus, MASK x (k - 1)]` blocks for B rows in one drafter pass per round."""

    def __init__(self, drafter: DFlashDraftModel, target: PreTrainedModel):
        self.drafter = drafter
        self.embedding = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.cache: DynamicCache | None = None  # chosen by the first pass, for its rows (`context_cache`)
        self.draft_temperature = draft_temperature(drafter)
        self.mask: torch.Tensor | None = None  # (B, T) validity of the cached context slots
        self.pending: torch.Tensor | None = None  # (B, C, n*Ht) target features not read yet
        self.pending_mask: torch.Tensor | None = None  # (B, C) their validity

    def add_context(self, features: torch.Tensor, valid: torch.Tensor) -> None:
        """Target features (B, C, n*Ht) of newly kept cache slots, valid where `valid` (B, C) is 1: the next
        pass reads them."""
        if self.pending is None:
            self.pending, self.pending_mask = features, valid
        else:
            self.pending = torch.cat([self.pending, features], 1)
            self.pending_mask = torch.cat([self.pending_mask, valid], 1)

    def draft_hidden(self, bonus: torch.LongTensor, block_length: int) -> torch.Tensor:
        """One drafter pass over `[bonus, MASK x (block_length - 1)]` after the pending context.

        bonus (B,) each row's last committed token. Each row's positions count its valid slots only.
        Returns the (B, block_length - 1, H) outputs of the mask slots.
        """
        context, context_mask = self.pending, self.pending_mask
        self.pending = self.pending_mask = None  # the drafter reads it now
        past_mask = self.mask if self.mask is not None else context_mask[:, :0]
        seen = past_mask.sum(1, keepdim=True)  # (B, 1) tokens whose features are already cached
        context_positions = (seen + context_mask.cumsum(1) - 1).clamp_min(0)
        bonus_position = seen + context_mask.sum(1, keepdim=True)  # = tokens before the bonus
        block_positions = bonus_position + torch.arange(block_length, device=bonus.device)
        self.mask = torch.cat([past_mask, context_mask], 1)
        positions = torch.cat([context_positions, block_positions], 1)
        mask = torch.cat([self.mask, self.mask.new_ones(bonus.shape[0], block_length)], 1)
        if self.cache is None:
            self.cache = context_cache(self.drafter.config, rows=bonus.shape[0])
        return drafter_pass(self.drafter, self.embedding, self.cache, bonus, context, positions, block_length, mask)

    def rewind(self, slots: int) -> None:
        """Forget the last `slots` context slots (the cost timing repeats one pass over the same context)."""
        self.cache.crop(-slots)
        self.mask = self.mask[:, :-slots]

    def draft(
        self,
        hidden: torch.Tensor,
        do_sample: bool,
        logits_processor=None,
        batch_size: int = 1,
        rows: list[int] | None = None,
        prefixes: list[torch.LongTensor] | None = None,
        anchors: torch.LongTensor | None = None,
        confidence: bool = False,
    ) -> Drafts:
        """Draft tokens from the drafter outputs (B, d, H) of `draft_hidden`.

        Greedy without logits processors: the argmax, without full-vocabulary logits (a pruned draft
        vocabulary scores only its own ids). Otherwise the draft logits are processed (every position with
        the row's committed prefix, `process_draft_rows`) and drafts are their argmax, or samples when
        `do_sample`. A DFlash2 drafter drafts by its selector's walk from each row's anchor (B,), the bonus
        token before the block (`selector.selector_drafts`). rows/prefixes/batch_size: as
        `process_draft_rows` needs them. `confidence`: also the drafter's probability of each draft
        (`Drafts.probabilities`).
        """
        selector = self.drafter.candidate_selector
        if do_sample and self.draft_temperature is not None:
            if self.draft_temperature == 0:  # deterministic drafts: q is one-hot, accepted with p(draft)
                return self.argmax_drafts(hidden, logits_processor, batch_size, rows, prefixes, anchors, confidence)
            logits_processor = at_temperature(logits_processor, self.draft_temperature)
        if not do_sample and not logits_processor:
            if selector is None and not confidence:
                return Drafts(self.drafter.greedy_draft_tokens(hidden, self.lm_head))
            if selector is None:  # the argmax and its probability, over the draft ids' logits alone
                logits = self.drafter.draft_logits(hidden, self.lm_head, full_vocab=False)
                best = logits.max(-1).indices
                ids = self.drafter.draft_token_ids
                return Drafts(best if ids is None else ids.to(best.device)[best], None, probability_of(logits, best))
            if anchors is not None:  # the walk over the draft ids' logits alone (no full-vocabulary scatter)
                logits = self.drafter.draft_logits(hidden, self.lm_head, full_vocab=False)
                path = selector.walk(hidden, logits, anchors, token_ids=self.drafter.draft_token_ids)[0]
                if not confidence:
                    return Drafts(path.tokens)
                return Drafts(path.tokens, None, probability_of(path.scores, path.choices))
        drafts = self.processed_drafts(hidden, do_sample, logits_processor, batch_size, rows, prefixes, anchors)
        if confidence:  # scores: the distributions drawn from (sampling), else logits / selector scores
            drafts.probabilities = (
                agreement_probability(drafts.scores) if do_sample else probability_of(drafts.scores, drafts.tokens)
            )
        return drafts

    def argmax_drafts(self, hidden, logits_processor, batch_size: int, rows, prefixes, anchors, confidence: bool):
        """Sampling with `draft_temperature` 0: the greedy drafts of the processed logits (a DFlash2 drafter: its
        selector's greedy walk), with one-hot draft distributions (B, d, V); `confidence`: the drafter's own
        probability of each draft."""
        drafts = self.processed_drafts(hidden, False, logits_processor, batch_size, rows, prefixes, anchors)
        probabilities = probability_of(drafts.scores, drafts.tokens) if confidence else None
        one_hot = torch.zeros(drafts.scores.shape, device=drafts.tokens.device).scatter_(
            -1, drafts.tokens[..., None], 1.0
        )
        return Drafts(drafts.tokens, one_hot, probabilities)

    def processed_drafts(self, hidden, do_sample: bool, logits_processor, batch_size: int, rows, prefixes, anchors):
        """`draft` from the full-vocabulary draft logits, processed with each row's prefix."""
        selector = self.drafter.candidate_selector
        logits = self.drafter.draft_logits(hidden, self.lm_head)  # (B, d, V)
        logits = process_draft_rows(logits_processor, batch_size, rows or [0], prefixes, logits)
        if selector is not None:
            if anchors is None:
                raise ValueError(
                    "A DFlash2 drafter drafts from each row's anchor: pass anchors (B,), the bonus tokens."
                )
            return Drafts(*selector_drafts(self.drafter, hidden, logits, anchors, do_sample, logits_processor))
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
        if index is not None and self.pending is not None:
            self.pending, self.pending_mask = self.pending[index], self.pending_mask[index]
        if self.mask is None:
            return
        if index is not None:
            self.cache.batch_select_indices(index)
            self.mask = self.mask[index]
        if needs_compaction(self.mask):
            self.mask = compact_cache(self.cache, self.mask)
