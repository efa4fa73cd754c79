"""Batched DFlash: ONE drafter pass and ONE target verification pass per round for all rows.

Rows accept different numbers of drafts, so their true lengths drift apart. The design keeps both
caches rectangular (one tensor per layer, one forward per round) and tracks per row which cache
slots are real:

  - every round appends k+1 slots to every row of the target cache (the block) and the accepted part
    of the previous block to every row of the drafter's context cache; the slots of rejected drafts
    stay (holes) and are masked out by a 2D validity mask, exactly like left padding;
  - each row's positions are its number of valid slots, which is what plain `generate` gives a
    left-padded row (`attention_mask.cumsum(-1) - 1`): the target sees the same keys and positions
    as in plain batched decoding, only at other cache slots;
  - the rejected tail common to all rows is cropped (a view, no copy); when the slots beyond the
    tightest left-padded layout exceed `MAX_WASTE_FRACTION` of a cache, it is compacted (each row's
    valid slots gathered in order, left-padded). Compacting costs one gather of the cache, like one
    `torch.cat` of `DynamicLayer.update`, and happens at most every ~T/(4k) rounds;
  - rows that finish leave the batch (index-select of caches and masks), so finished rows cost nothing.

Rejected alternatives: per-row caches (B forwards per round); re-aligning every row each round (a
copy of the whole cache every round). Holes break sliding windows (a window counts slots), so
sliding-window layers are only accepted where the window can never be reached.

The output equals plain `generate` of the same left-padded batch: stopping criteria are checked per
row after each committed token; with an EOS criterion a finished row is padded with `pad_token_id`
(plain `generate` feeds it pad tokens), without one it keeps decoding until every row has stopped,
as plain `generate` does.
"""

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..caches import compact_cache, needs_compaction
from ..modeling_dflash import DFlashDraftModel
from ..target_features import target_layer_features
from .adaptive import block_size_controller
from .candidate_generator import AcceptanceStats
from .pairing import check_pairing
from .verification import (
    count_until_stop,
    greedy_tokens,
    is_position_independent,
    process_block_logits,
    process_draft_logits,
    speculative_sample,
)


class BatchedDrafter:
    """The drafter side of batched DFlash: its context cache and the validity mask of its slots."""

    def __init__(self, drafter: DFlashDraftModel, target: PreTrainedModel):
        config = drafter.config
        self.drafter = drafter
        self.embedding = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.mask_token_id = config.mask_token_id
        self.cache = DynamicCache(config=config)
        self.mask: torch.Tensor | None = None  # (B, T) validity of the cached context slots

    def draft(
        self,
        bonus: torch.LongTensor,
        context: torch.Tensor,
        context_mask: torch.Tensor,
        num_drafts: int,
        block_length: int,
    ):
        """Draft `num_drafts` tokens after each row's bonus token in one drafter pass over a block of
        `block_length` <= block_size tokens `[bonus, MASK x (block_length - 1)]`, num_drafts < block_length.

        bonus (B,) the last committed token of each row; context (B, C, n*Ht) target features of the
        tokens committed since the last call, valid where context_mask (B, C) is 1.
        Returns the drafter outputs (B, num_drafts, H) of the draft slots (`logits` or `greedy_tokens` read them).
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
        return hidden[:, 1 : 1 + num_drafts]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, d, V) draft logits of `draft`'s (B, d, H) outputs."""
        return self.drafter.draft_logits(hidden, self.lm_head)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.LongTensor:
        """(B, d) argmax drafts of `draft`'s outputs (no full-vocabulary logits with a pruned draft vocabulary)."""
        return self.drafter.greedy_draft_tokens(hidden, self.lm_head)

    def prune(self, index: torch.LongTensor | None) -> None:
        """Keep the rows `index` (B',) (None: all) and compact the cache when its holes exceed the bound."""
        if self.mask is None:
            return
        if index is not None:
            self.cache.batch_select_indices(index)
            self.mask = self.mask[index]
        if needs_compaction(self.mask):
            self.mask = compact_cache(self.cache, self.mask)


def check_batched_support(cache, drafter: DFlashDraftModel, generation_config: GenerationConfig, streamer) -> None:
    """Refuse, with the reason, what batched DFlash does not support (yet)."""
    if streamer is not None:
        raise ValueError("Streamers need batch size 1 with a DFlash assistant; drop `streamer` or pass one prompt.")
    wanted = [
        name for name in ("output_scores", "output_logits", "output_hidden_states") if getattr(generation_config, name)
    ]
    if wanted and generation_config.return_dict_in_generate:
        raise ValueError(f"{', '.join(wanted)} need batch size 1 with a DFlash assistant (batched: sequences only).")
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"Batched DFlash needs a DynamicCache for the target, got {type(cache).__name__}.")
    # Holes between a row's slots would shift a sliding window; allow windows no cache can reach.
    reachable = 2 * generation_config.max_length + drafter.config.block_size
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        if layer.is_sliding and window is not None and window <= reachable:
            raise ValueError(
                f"Batched DFlash does not support a target sliding window ({window} tokens) that generation can "
                f"reach (up to {reachable} cache slots); generate one prompt at a time."
            )
    if "sliding_attention" in drafter.config.layer_types:
        raise ValueError(
            "Batched DFlash does not support drafters with sliding-window layers; pass one prompt at a time."
        )


def row_copies(sequence: torch.LongTensor, batch_size: int) -> torch.LongTensor:
    """(batch_size, L) view repeating one row's sequence (L,).

    Rows differ in length, so logits processors and stopping criteria see one row at a time; they
    see it in a batch of the original size and we read back its own index, so those holding per-row
    state of the original batch (the repetition penalty's prompt padding, a `prefix_allowed_tokens_fn`'s
    batch id) use that row's state.
    """
    return sequence[None].expand(batch_size, -1)


def process_rows(logits_processor, batch_size: int, rows: list[int], prefixes: list[torch.LongTensor], drafts, logits):
    """Processed float target logits (B, k+1, V) of every active row, as plain decoding processes them.

    rows: each entry's row in the original batch of `batch_size`; prefixes: B committed sequences
    (L_b,); drafts (B, k); logits (B, k+1, V). Position t of entry b is processed with prefix
    prefixes[b] + drafts[b, :t].
    """
    if not logits_processor:
        return logits.float()
    if is_position_independent(logits_processor):  # no input_ids, no per-row state: one call
        return process_draft_logits(logits_processor, drafts[:, :0], logits)
    processed = []
    for b, (row, prefix) in enumerate(zip(rows, prefixes)):
        sequence = row_copies(torch.cat([prefix, drafts[b]]), batch_size)
        row_logits = logits[b : b + 1].repeat(batch_size, 1, 1)
        processed.append(process_block_logits(logits_processor, sequence, row_logits, start=len(prefix))[row])
    return torch.stack(processed)


def process_drafts(logits_processor, logits: torch.Tensor) -> torch.Tensor:
    """Draft logits (B, k, V) -> float, processed by the position-independent processors only.

    Drafts need *a* well-defined distribution (verification corrects it); processors that read
    input_ids (repetition penalty, n-gram blocking, min length) are left to the verification, which
    saves a per-row, per-position loop.
    """
    positional = LogitsProcessorList(p for p in logits_processor or () if is_position_independent([p]))
    return process_draft_logits(positional, logits.new_zeros(logits.shape[0], 0, dtype=torch.long), logits)


@torch.no_grad()
def batched_dflash_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config: GenerationConfig,
    assistant_model: DFlashDraftModel,
    streamer=None,
    **model_kwargs,
) -> tuple[torch.LongTensor, AcceptanceStats]:
    """DFlash for a left-padded batch (B, P). Returns the sequences (B, L) as plain `generate`
    returns them and the acceptance statistics (τ of every row in every verification round)."""
    check_pairing(model, assistant_model)
    cache_key = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(cache_key)
    check_batched_support(cache, assistant_model, generation_config, streamer)
    cache.activate_past_recording()
    drafter = BatchedDrafter(assistant_model, model)
    controller = block_size_controller(assistant_model, model, batch_size=input_ids.shape[0])
    layer_ids = list(assistant_model.config.target_layer_ids)
    hidden_request = {"output_hidden_states": [i + 1 for i in layer_ids]}
    block_size, do_sample = assistant_model.config.block_size, bool(generation_config.do_sample)
    stats = AcceptanceStats(block_size=block_size)

    batch, prompt_length = input_ids.shape
    max_length = generation_config.max_length
    # With an EOS criterion plain `generate` pads finished rows; without one they keep decoding.
    pad_finished = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    pad = generation_config._pad_token_tensor
    pad = int(pad) if pad is not None else 0
    sequences = input_ids.new_full((batch, max_length), pad)  # row b's tokens are sequences[b, :lengths[b]]
    sequences[:, :prompt_length] = input_ids
    lengths = [prompt_length] * batch
    stop_lengths: dict[int, int] = {}  # row -> length at which a stopping criterion was met
    cap = max_length  # without EOS padding: the common final length once every row has stopped
    rows = list(range(batch))  # original row of each batch entry

    # Prefill: plain `generate`'s first forward, which also yields the prompt features.
    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    if "logits_to_keep" in model_inputs:
        model_inputs["logits_to_keep"] = 1
    outputs = model(**(model_inputs | hidden_request))
    target_mask = model_kwargs.get("attention_mask")
    if target_mask is None:
        target_mask = input_ids.new_ones(batch, prompt_length)
    processed = process_block_logits(logits_processor, input_ids, outputs.logits[:, -1:], start=prompt_length)
    new_tokens = torch.multinomial(processed[:, 0].softmax(-1), 1) if do_sample else greedy_tokens(processed)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
    context = target_layer_features(outputs.hidden_states, layer_ids, prompt_length)
    context_mask = target_mask
    num_drafts = None  # None: the last forward was the prefill

    while True:
        # Commit each row's tokens one by one up to its first stop, as plain decoding would.
        finished = []
        for i, row in enumerate(rows):
            start = lengths[row]
            tokens = new_tokens[i, : int(num_accepted[i]) + 1][: cap - start]
            end = start + len(tokens)
            sequences[row, start:end] = tokens
            if row not in stop_lengths:
                copies = row_copies(sequences[row, :end], batch)
                kept, stopped = count_until_stop(stopping_criteria, copies, start, None, row=row)
                if stopped:
                    stop_lengths[row] = start + kept
                    if pad_finished:
                        sequences[row, start + kept : end] = pad
                        end = start + kept
            lengths[row] = end
            if num_drafts is not None:
                stats.acceptance_lengths.append(end - start)
            finished.append((pad_finished and row in stop_lengths) or end >= cap)
        if not pad_finished and len(stop_lengths) == batch:
            cap = max(stop_lengths.values())  # plain decoding stops when the last row does
            finished = [lengths[row] >= cap for row in rows]
        keep = [i for i, done in enumerate(finished) if not done]
        if not keep:
            break

        if num_drafts is not None:
            # Slots 0..n_b of the block hold the bonus and the accepted drafts; the rest are holes.
            slot_valid = (torch.arange(num_drafts + 1, device=input_ids.device) <= num_accepted[:, None]).long()
            used = int(num_accepted.max()) + 1  # slots past this are rejected in every row: crop them
            cache.crop(used - num_drafts - 1)
            target_mask = torch.cat([target_mask, slot_valid[:, :used]], 1)
            features = target_layer_features(outputs.hidden_states, layer_ids, used)
            if context is None:  # the drafter consumed the previous context
                context, context_mask = features, slot_valid[:, :used]
            else:
                context = torch.cat([context, features], 1)
                context_mask = torch.cat([context_mask, slot_valid[:, :used]], 1)
        index = None
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=input_ids.device)
            cache.batch_select_indices(index)
            target_mask, context, context_mask = target_mask[index], context[index], context_mask[index]
            rows = [rows[i] for i in keep]
        drafter.prune(index)
        if needs_compaction(target_mask):
            target_mask = compact_cache(cache, target_mask)

        # One drafter pass over a block of k tokens drafts k - 1 tokens for every row; never past the
        # longest row's limit. k = 1: no drafter pass, the context waits for the next one.
        prefixes = [sequences[row, : lengths[row]] for row in rows]
        bonus = torch.stack([prefix[-1] for prefix in prefixes])
        block_length = controller.choose(rows)
        stats.block_sizes.append(block_length)
        num_drafts = max(0, min(block_length - 1, max(cap - lengths[row] - 1 for row in rows)))
        draft_probs = None
        if num_drafts:
            draft_hidden = drafter.draft(bonus, context, context_mask, num_drafts, block_length)
            context = None
            if not do_sample and not logits_processor:
                drafts = drafter.greedy_tokens(draft_hidden)
            else:
                draft_logits = process_drafts(logits_processor, drafter.logits(draft_hidden))
                if do_sample:
                    draft_probs = draft_logits.softmax(-1)
                    drafts = torch.multinomial(draft_probs.flatten(0, 1), 1).view(len(rows), num_drafts)
                else:
                    drafts = greedy_tokens(draft_logits)
        else:
            drafts = bonus.new_empty(len(rows), 0)

        # One target pass verifies [bonus, drafts] of every row at its own positions.
        block = torch.cat([bonus[:, None], drafts], 1)
        model_inputs = model.prepare_inputs_for_generation(
            block,
            attention_mask=torch.cat([target_mask, target_mask.new_ones(block.shape)], 1),
            position_ids=target_mask.sum(1, keepdim=True) + torch.arange(num_drafts + 1, device=block.device),
            use_cache=True,
            **{cache_key: cache},
        )
        outputs = model(**(model_inputs | hidden_request))
        processed = process_rows(logits_processor, batch, rows, prefixes, drafts, outputs.logits[:, -num_drafts - 1 :])
        if do_sample:
            new_tokens, num_accepted = sample_rows(drafts, draft_probs, processed.softmax(-1))
        else:
            new_tokens = greedy_tokens(processed)  # (B, k+1): the target's token after each prefix
            num_accepted = ((drafts != new_tokens[:, :-1]).int().cumsum(1) == 0).sum(1)
        controller.observe(rows, num_drafts, num_accepted)

    assistant_model.last_acceptance = stats
    width = max(min(length, cap) for length in lengths)
    return sequences[:, :width], stats


def sample_rows(drafts: torch.LongTensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor):
    """Leviathan rejection sampling row by row. drafts (B, k), draft_probs (B, k, V) or None when
    k = 0, target_probs (B, k+1, V). Returns tokens (B, k+1) (valid up to n_b+1) and n_b (B,)."""
    tokens = drafts.new_zeros(target_probs.shape[:2])
    num_accepted = drafts.new_zeros(drafts.shape[0])
    for b in range(drafts.shape[0]):
        if drafts.shape[1]:
            row = speculative_sample(drafts[b : b + 1], draft_probs[b : b + 1], target_probs[b : b + 1])[0]
        else:
            row = torch.multinomial(target_probs[b, 0], 1)
        tokens[b, : len(row)] = row
        num_accepted[b] = len(row) - 1
    return tokens, num_accepted
