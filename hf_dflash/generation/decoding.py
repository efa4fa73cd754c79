"""The one DFlash decoding loop that `generate` runs when the assistant is a DFlash drafter.

It keeps `generate`'s own preparation (generation config, logits processors, stopping criteria, cache,
streamer) and serves any batch size. Every round is the same steps over the active rows:

    propose  the call's drafting strategy drafts (`drafting/`: chains, drafter trees, hybrid drafting in
             `drafting/strategies/`, from the drafter pass, the selector and the n-gram source)
    verify   ONE target forward over [unread tokens, drafts] (`verifying/target_forward.py`: eager, or compiled
             at one width)
    accept   the longest prefix each row's target agrees with (trees: the longest path), or Leviathan
             rejection sampling (`verifying/verdict.py`)
    commit   each row's tokens one by one up to its first stop (EOS, stop string, length, time, custom), so a
             stop met inside an accepted block ends the output exactly where plain decoding does (`rows.py`)
    rollback the cache slots of rejected drafts are dropped or masked (`target_slots.py`); the kept slots'
             target features become the drafter's next context
    observe  the strategy learns from the round through its policies (`policies/`: block sizes, tree sizes, the
             hybrid budget, and the cost model that prices them)

The folders are the steps (`drafting/`, `verifying/`, `policies/`); the loop, the rows, the cache slots, what is
refused (`options.py`) and the hook into `generate` (`hook.py`) sit beside them.

Lossless by construction: a row sees exactly the keys and positions plain decoding gives it, and every token it
commits is the target's own choice (greedy) or distributed as the target's (sampling). Beyond Transformers'
built-in loop (5.23-5.25): any batch size; drafts never extend past `max_length`; logits processors run once over
a block when they do not read input_ids; `return_dict_in_generate` with scores, logits and hidden states
(batch 1); acceptance statistics (`DFlashGenerateOutput.acceptance_lengths`, `drafter.last_acceptance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..modeling_dflash import DFlashDraftModel
from ..target_features import target_layer_features
from .drafting.strategies import drafting_strategy
from .linear_packing import loop_linear_packing
from .options import check_cache, check_decoding_options
from .pairing import check_pairing
from .rows import Rows
from .stats import AcceptanceStats
from .target_slots import TargetSlots
from .verifying.target_forward import compiled_verification, verifier
from .verifying.verdict import Verdict, judge

# Transformers 5.24 renamed the output's `past_key_values` field to `cache`.
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `acceptance_lengths` (τ of each verification round)."""

    acceptance_lengths: list[int] | None = None


def dflash_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    """Same signature and return types as `GenerationMixin._assisted_decoding`, for any batch size
    (left-padded prompts with their attention mask)."""
    check_decoding_options(model, input_ids, generation_config, streamer, model_kwargs)
    check_pairing(model, assistant_model)
    cache_key = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(cache_key)
    check_cache(cache, assistant_model, generation_config, input_ids)
    cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts
    with torch.no_grad(), loop_linear_packing(model, assistant_model):
        loop = DecodingLoop(model, assistant_model, logits_processor, stopping_criteria, generation_config, streamer)
        sequences = loop.run(input_ids, cache_key, model_kwargs)
    assistant_model.last_acceptance = loop.stats
    if not generation_config.return_dict_in_generate:
        return sequences
    return DFlashGenerateOutput(
        sequences=sequences,
        scores=loop.scores,
        logits=loop.raw_logits,
        hidden_states=loop.hidden_states,
        # rows that finished early left the cache: it is returned only when it still holds every row
        **{CACHE_FIELD: cache if input_ids.shape[0] == 1 else None},
        acceptance_lengths=list(loop.stats.acceptance_lengths),
    )


class DecodingLoop:
    """One `generate` call: its settings, statistics and optional outputs; `run` performs the rounds."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDraftModel,
        logits_processor,
        stopping_criteria,
        generation_config: GenerationConfig,
        streamer=None,
    ):
        self.target, self.drafter = target, drafter
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.generation_config, self.streamer = generation_config, streamer
        self.do_sample = bool(generation_config.do_sample)
        self.layer_ids = list(drafter.config.target_layer_ids)
        # The drafter needs a few layers' hidden states; a caller asking for all of them gets all of them.
        wants_all = bool(generation_config.output_hidden_states)
        self.hidden_request = {"output_hidden_states": True if wants_all else [i + 1 for i in self.layer_ids]}
        self.stats = AcceptanceStats(block_size=drafter.config.block_size)
        want_dict = generation_config.return_dict_in_generate
        self.scores = () if want_dict and generation_config.output_scores else None
        self.raw_logits = () if want_dict and generation_config.output_logits else None
        self.hidden_states = () if want_dict and wants_all else None

    def run(self, input_ids: torch.LongTensor, cache_key: str, model_kwargs: dict) -> torch.LongTensor:
        """Decode the left-padded prompts (B, P); returns the sequences (B, L) as plain `generate` does."""
        config, batch = self.generation_config, input_ids.shape[0]
        # With an EOS criterion plain `generate` pads finished rows; without one they keep decoding.
        pad_finished = any(hasattr(criteria, "eos_token_id") for criteria in self.stopping_criteria)
        pad = 0 if config._pad_token_tensor is None else int(config._pad_token_tensor)
        rows = Rows(input_ids, config.max_length, pad, pad_finished)
        slots = TargetSlots(model_kwargs[cache_key], cache_key, batch, input_ids.device, pad)
        compiled = compiled_verification(self.target, config, model_kwargs)
        strategy = drafting_strategy(
            self.drafter, self.target, config, self.logits_processor, slots.cache, batch, compiled is not None
        )
        check = verifier(self.target, slots, strategy, self.hidden_request, compiled)
        unread = input_ids  # (R, u) committed tokens the target has not read; round 0 (the prefill): the prompt
        unread_mask = model_kwargs.get("attention_mask")
        unread_mask = input_ids.new_ones(input_ids.shape) if unread_mask is None else unread_mask
        prefill = True
        while True:
            prefixes = rows.prefixes()
            proposal = strategy.propose(rows, prefill)
            outputs = check.verify(unread, unread_mask, proposal, prefill, model_kwargs)
            verdict = judge(proposal, outputs, prefixes, self.logits_processor, self.do_sample, batch, rows.active)
            committed = rows.commit(verdict.new_tokens, verdict.num_accepted, self.stopping_criteria, self.scores)
            if not prefill or proposal.num_drafts:  # a round (the prefill counts when it verified n-gram drafts)
                self.stats.record_round(proposal.block_length, committed.tolist(), prefill)
                strategy.observe(rows, proposal, verdict, committed, self.stats)
            self.stream(rows, committed)
            if batch == 1:
                self.record_outputs(rows, int(committed[0]), verdict, prefill)
            kept = slots.keep(committed, unread_mask, proposal.num_drafts, proposal.tree, verdict.path)
            strategy.block.add_context(
                target_layer_features(verdict.hidden_states, self.layer_ids, kept.shape[1]), kept
            )
            still = rows.still_decoding()
            if not still:
                break
            index = torch.tensor(still, device=slots.mask.device) if len(still) < len(rows.active) else None
            rows.keep(still)
            slots.prune(index)
            strategy.block.prune(index)
            unread = rows.last_tokens()[:, None]
            if prefill:  # compiled verification: compile the rounds' graphs now, not inside a timed round
                check.warm_graphs(len(rows.active))
            unread_mask, prefill = unread.new_ones(unread.shape), False
        if self.streamer is not None:
            self.streamer.end()
        return rows.output()

    def stream(self, rows: Rows, committed: torch.LongTensor) -> None:
        if self.streamer is not None:
            start = rows.round_starts[0]
            self.streamer.put(rows.sequences[:1, start : start + int(committed[0])].cpu())

    def record_outputs(self, rows: Rows, kept: int, verdict: Verdict, prefill: bool) -> None:
        """Scores, logits and hidden states of the committed tokens, one entry per token (batch 1)."""
        if self.scores is not None:
            self.scores += tuple(verdict.processed[:, i] for i in range(kept))
        if self.raw_logits is not None:
            self.raw_logits += tuple(verdict.raw_logits[:, i] for i in range(kept))
        if self.hidden_states is not None:
            prompt_length = rows.lengths[0] - kept
            self.hidden_states += split_hidden_states(verdict.hidden_states, prompt_length, kept, prefill)


def split_hidden_states(layer_states: tuple, prompt_length: int, kept: int, prefill: bool) -> tuple:
    """Per-token hidden states as plain decoding returns them: the prefill step covers the prompt and
    the first token; every later token gets its own (B, 1, H) slice per layer (after a prefill that
    verified drafts: those of the accepted drafts, which follow the prompt)."""
    if prefill:
        first = (tuple(h[:, :prompt_length] for h in layer_states),)
        return first + tuple(
            tuple(h[:, t : t + 1] for h in layer_states) for t in range(prompt_length, prompt_length + kept - 1)
        )
    return tuple(tuple(h[:, t : t + 1] for h in layer_states) for t in range(kept))
