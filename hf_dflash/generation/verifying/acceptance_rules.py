"""Pure functions of one verification step: logits processing, greedy acceptance, speculative sampling.

Shapes: B = batch (1 here; the batched loop applies these row by row), k = drafted tokens this round, V = vocabulary.
"""

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# One copy of the acceptance rules: the self-contained Hub loop (custom_generate/generate.py) defines them.
from ...modeling_dflash.custom_generate import accepted_lengths, speculative_sample  # noqa: F401  (re-exported)

# Processors whose output depends only on the scores, never on input_ids (checked against
# Transformers 5.23-5.25): they can process every position of a block in one vectorised call.
POSITION_INDEPENDENT_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


def is_position_independent(logits_processor: LogitsProcessorList | None) -> bool:
    return all(isinstance(p, POSITION_INDEPENDENT_PROCESSORS) for p in logits_processor or ())


def process_block_logits(
    logits_processor: LogitsProcessorList | None, sequence: torch.LongTensor, logits: torch.Tensor, start: int
) -> torch.Tensor:
    """Apply `logits_processor` to each of the T positions of a block, exactly as step-by-step decoding would.

    sequence (B, L) holds the tokens; logits (B, T, V) are the scores for the tokens at positions
    start, start+1, ..., so position t is processed with prefix sequence[:, :start + t].
    Returns float32 (B, T, V). Position-independent processors run once over all positions;
    others (repetition penalty, min length, ...) run per position with the right prefix.
    """
    if not logits_processor or is_position_independent(logits_processor):
        return process_draft_logits(logits_processor, sequence[:, :start], logits)
    logits = logits.float()
    return torch.stack([logits_processor(sequence[:, : start + t], logits[:, t]) for t in range(logits.shape[1])], 1)


def process_draft_logits(
    logits_processor: LogitsProcessorList | None, sequence: torch.LongTensor, logits: torch.Tensor
) -> torch.Tensor:
    """Apply `logits_processor` to all k draft positions at once with the committed prefix (B, L).

    logits (B, k, V) -> float32 (B, k, V). Drafts only need *a* well-defined distribution (the
    verification step corrects it), so one vectorised call replaces a per-token loop.
    """
    logits = logits.float()
    if not logits_processor:
        return logits
    batch, length, vocab = logits.shape
    flat = logits_processor(sequence.repeat_interleave(length, 0), logits.reshape(batch * length, vocab))
    return flat.view(batch, length, vocab)


def greedy_tokens(logits: torch.Tensor) -> torch.LongTensor:
    """Argmax over the vocabulary, first index on ties like `argmax`. `max(-1).indices` is ~3x
    faster than `argmax(-1)` for (k, 49152) float32 on CPU (torch 2.13)."""
    return logits.max(-1).indices


def sample_rows(drafts: torch.LongTensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor):
    """`speculative_sample` row by row. drafts (B, k), draft_probs (B, k, V) or None when k = 0,
    target_probs (B, k+1, V). Returns tokens (B, k+1) (row b valid up to n_b + 1) and n_b (B,)."""
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


def row_copies(sequence: torch.LongTensor, batch_size: int) -> torch.LongTensor:
    """(batch_size, L) view repeating one row's sequence (L,).

    Rows differ in length, so logits processors and stopping criteria see one row at a time; they
    see it in a batch of the original size and we read back its own index, so those holding per-row
    state of the original batch (the repetition penalty's prompt padding, a `prefix_allowed_tokens_fn`'s
    batch id) use that row's state.
    """
    return sequence[None].expand(batch_size, -1)


def process_rows(
    logits_processor, batch_size: int, rows: list[int], prefixes: list[torch.LongTensor], drafts, logits
) -> torch.Tensor:
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


def process_draft_rows(
    logits_processor, batch_size: int, rows: list[int], prefixes: list[torch.LongTensor] | None, logits
) -> torch.Tensor:
    """Draft logits (B, d, V) -> float32, every position of row b processed with its committed prefix
    prefixes[b] (L_b,) (drafts only need *a* well-defined distribution: verification corrects it, so the
    drafts before a position are not part of its prefix). Position-independent processors run in one
    vectorised call; others once per row and position, on copies of the row (see `row_copies`)."""
    if not logits_processor or is_position_independent(logits_processor):
        return process_draft_logits(logits_processor, logits.new_zeros(logits.shape[0], 0, dtype=torch.long), logits)
    processed = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for b, (row, prefix) in enumerate(zip(rows, prefixes)):
        sequence = row_copies(prefix, batch_size)
        for t in range(logits.shape[1]):
            processed[b, t] = logits_processor(sequence, logits[b, t].float().repeat(batch_size, 1))[row]
    return processed


def count_until_stop(
    stopping_criteria, sequence: torch.LongTensor, start: int, scores, row: int = 0
) -> tuple[int, bool]:
    """Number of tokens of sequence[row, start:] to keep: stop at the first prefix that meets a criterion.

    sequence (B, L); only `row`'s verdict counts (the batched loop passes copies of one row so that
    criteria holding per-row state see it at its own index). Returns (kept, stopped).
    """
    for end in range(start + 1, sequence.shape[1] + 1):
        if bool(stopping_criteria(sequence[:, :end], scores)[row]):
            return end - start, True
    return sequence.shape[1] - start, False
