"""What DFlash decoding refuses before it starts, with the reason: options, caches and what they can verify."""

from __future__ import annotations

import transformers
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache, StaticLayer

from ..modeling_dflash import DFlashDraftModel
from .target_slots import cache_capacity

# Transformers' options that steer an autoregressive assistant, and why none applies to a DFlash drafter (it
# drafts its whole block in one pass and shares the target's tokenizer), with what to use instead.
ASSISTANT_OPTIONS = {
    "num_assistant_tokens": "a DFlash drafter drafts block_size - 1 tokens per round: set drafter.block_size_policy "
    "= k for k - 1 drafts per round",
    "num_assistant_tokens_schedule": "set drafter.block_size_policy = 'adaptive' to choose the block each round",
    "assistant_confidence_threshold": "a DFlash drafter drafts its block in one pass and does not stop early; drop it",
    "assistant_ensemble_weight": "it would change the acceptance rule, and DFlash verification stays lossless; drop it",
    "assistant_early_exit": "that is self-speculation with the target's own early layers; drop the DFlash assistant "
    "or this option",
    "assistant_lookbehind": "a DFlash drafter shares the target's tokenizer (no universal assisted decoding); drop it",
    "target_lookbehind": "a DFlash drafter shares the target's tokenizer (no universal assisted decoding); drop it",
}


def assistant_option_defaults() -> dict:
    """The values `generate` fills in for the assisted-generation options a caller did not set (Transformers 5.25
    keeps them in `_get_default_generation_params`; 5.23-5.24 set them in `GenerationConfig()`)."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:
        return defaults()
    config = GenerationConfig()
    return {name: getattr(config, name, None) for name in ASSISTANT_OPTIONS}


def check_decoding_options(model, input_ids, generation_config, streamer, model_kwargs: dict) -> None:
    """Refuse, with the reason, what DFlash decoding does not support."""
    batch_size = input_ids.shape[0]
    defaults = assistant_option_defaults()
    for name, reason in ASSISTANT_OPTIONS.items():
        value = getattr(generation_config, name, None)
        if value is not None and value != defaults.get(name):
            raise ValueError(f"{name}={value!r} does not apply to a DFlash assistant: {reason}.")
    ngram = generation_config.prompt_lookup_num_tokens
    if ngram is not None and (not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1):
        raise ValueError(f"prompt_lookup_num_tokens must be an int >= 1 (n-gram drafts per round), got {ngram!r}.")
    if input_ids.shape[1] == 0:
        given = "inputs_embeds" if model_kwargs.get("inputs_embeds") is not None else "no prompt"
        raise ValueError(
            f"DFlash decoding needs the prompt's token ids (got {given}): the drafter reads the committed tokens. "
            "Pass input_ids (with inputs_embeds only if the target needs them too)."
        )
    if generation_config.output_attentions:
        raise ValueError("output_attentions=True is not supported with a DFlash assistant; drop it.")
    if model.config.is_encoder_decoder:
        raise ValueError("DFlash drafters serve decoder-only targets; this target is encoder-decoder.")
    if batch_size == 1:
        return
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            f"Hybrid drafting (prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens} with a DFlash "
            f"assistant) supports batch size 1, got {batch_size} prompts: generate them one by one, or "
            "drop prompt_lookup_num_tokens for batched DFlash."
        )
    if streamer is not None:
        raise ValueError("Streamers need batch size 1 with a DFlash assistant; drop `streamer` or pass one prompt.")
    wanted = [
        name for name in ("output_scores", "output_logits", "output_hidden_states") if getattr(generation_config, name)
    ]
    if wanted and generation_config.return_dict_in_generate:
        raise ValueError(f"{', '.join(wanted)} need batch size 1 with a DFlash assistant (batched: sequences only).")


def reachable_slots(max_length: int, round_width: int, holes: bool = False) -> int:
    """The most cache slots generation can fill: the committed tokens and one round's drafts; with `holes` (a
    batch: each rejected draft leaves a hole that is not reused until compaction) up to twice the tokens."""
    return (2 if holes else 1) * max_length + round_width


def check_cache(cache, drafter: DFlashDraftModel, generation_config: GenerationConfig, input_ids) -> None:
    """The target cache must exist and roll back; with several rows it must be a DynamicCache whose sliding
    windows (if any) generation cannot reach, since the holes of rejected drafts would shift a window (a
    window counts slots), or a StaticCache without windows. A drafter's windows need no check: with several
    rows its cache keeps every slot and its mask counts a window in tokens (`BlockDrafter`)."""
    if cache is None:
        raise ValueError("DFlash generation needs a target cache; do not pass use_cache=False.")
    fixed = sorted({type(layer).__name__ for layer in cache.layers if not getattr(layer, "is_croppable", True)})
    if fixed:
        raise ValueError(
            f"DFlash rolls rejected drafts back out of the target cache, and this cache's {', '.join(fixed)} layers "
            f"cannot be rolled back in Transformers {transformers.__version__} (static layers can from 5.24 on): "
            "drop cache_implementation / the cache argument for the default dynamic cache, or upgrade Transformers."
        )
    if cache.is_compileable:
        capacity = cache_capacity(cache)
        if capacity <= input_ids.shape[1]:
            needed = generation_config.max_length + drafter.config.block_size
            raise ValueError(
                f"The target's {type(cache).__name__} holds {capacity} slots and the prompt has {input_ids.shape[1]} "
                f"tokens: pass a cache with max_cache_len >= {needed} (max_length + the drafter's block)."
            )
    batch_size = input_ids.shape[0]
    if batch_size == 1:
        return
    static = isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)
    if not isinstance(cache, DynamicCache) and not static:
        raise ValueError(
            f"Batched DFlash needs a DynamicCache or a StaticCache of full-attention layers for the target, got "
            f"{type(cache).__name__} ({', '.join(sorted({type(layer).__name__ for layer in cache.layers}))})."
        )
    reachable = reachable_slots(generation_config.max_length, drafter.config.block_size, holes=True)
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        if layer.is_sliding and window is not None and window <= reachable:
            raise ValueError(
                f"Batched DFlash does not support a target sliding window ({window} tokens) that generation can "
                f"reach (up to {reachable} cache slots); generate one prompt at a time."
            )


def verifies_trees(model: PreTrainedModel, cache, max_length: int, max_nodes: int) -> bool:
    """Whether the target can verify a draft tree of `max_nodes` in one forward (batch 1): an attention that takes
    our 4D mask (eager, SDPA) and a DynamicCache whose layers are full attention, or sliding windows that
    generation cannot reach (the tree mask does not encode a window), or a StaticCache of full-attention layers
    with room for a whole tree after `max_length` tokens (the mask then spans all its slots)."""
    if model.config._attn_implementation not in ("eager", "sdpa") or type(cache) not in (DynamicCache, StaticCache):
        return False
    reachable = reachable_slots(max_length, max_nodes)
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window <= reachable:
            return False
        if type(layer) is StaticLayer and layer.max_cache_len < reachable:
            return False
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer):
            return False
    return True
