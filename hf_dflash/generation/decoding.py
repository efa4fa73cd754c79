"""The DFlash decoding loop that `generate` runs when the assistant is a DFlash drafter.

It keeps `generate`'s own preparation (generation config, logits processors, stopping criteria,
cache, streamer) and the `CandidateGenerator` contract, and replaces the built-in assisted loop
(Transformers 5.23-5.24) where that loop is not lossless or not lean enough for DFlash:
  - every stopping criterion (EOS, stop strings, max time, custom) is checked after EACH committed
    token, so a stop met inside an accepted block ends the output exactly where plain decoding does;
  - drafts never extend past `max_length`;
  - target logits processors run once over the block when they do not read input_ids;
  - `return_dict_in_generate` with `output_hidden_states`/`output_scores`/`output_logits` works;
  - acceptance statistics are returned (`DFlashGenerateOutput.acceptance_lengths`) and kept on the
    drafter (`drafter.last_acceptance`);
  - the block length may change every round (`drafter.block_size_policy`, see `adaptive.py`);
  - hybrid drafting (`prompt_lookup_num_tokens` beside the DFlash assistant, batch size 1): the block
    and an n-gram continuation are verified as one draft tree in ONE target forward (greedy), or the
    branch is chosen before verification (sampling, or targets that cannot take a tree mask). A chain
    is the tree of one branch, so this is the same loop: only the mask/positions of the forward, the
    acceptance walk and the cache gather differ, and after acceptance everything is laid out along
    the accepted path (`tree.py`).
A batch of several (left-padded) prompts runs `batched.batched_dflash_decoding`: one drafter pass
and one target pass per round for all rows.
"""

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .adaptive import block_size_controller, tree_budget
from .batched import batched_dflash_decoding
from .candidate_generator import DFlashCandidateGenerator
from .ngram import DEFAULT_MAX_NGRAM_SIZE, PromptLookup
from .tree import greedy_tree_path, keep_tree_path, process_tree_logits, tree_attention_bias, tree_depths
from .verification import (
    count_until_stop,
    greedy_accept,
    greedy_tokens,
    process_block_logits,
    speculative_sample,
)

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
    """Same signature and return types as `GenerationMixin._assisted_decoding`.

    Batch size > 1 (left-padded prompts with their attention mask) runs `batched_dflash_decoding`.
    """
    if generation_config.output_attentions:
        raise ValueError("output_attentions=True is not supported with a DFlash assistant; drop it.")
    if model.config.is_encoder_decoder:
        raise ValueError("DFlash drafters serve decoder-only targets; this target is encoder-decoder.")
    prompt_lookup = None
    if generation_config.prompt_lookup_num_tokens is not None:
        if input_ids.shape[0] > 1:
            raise ValueError(
                f"Hybrid drafting (prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens} with a DFlash "
                f"assistant) supports batch size 1, got {input_ids.shape[0]} prompts: generate them one by one, or "
                "drop prompt_lookup_num_tokens for batched DFlash."
            )
        max_ngram_size = generation_config.max_matching_ngram_size
        prompt_lookup = PromptLookup(
            generation_config.prompt_lookup_num_tokens,
            DEFAULT_MAX_NGRAM_SIZE if max_ngram_size is None else max_ngram_size,
        )
    if input_ids.shape[0] > 1:
        sequences, stats = batched_dflash_decoding(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            assistant_model,
            streamer,
            **model_kwargs,
        )
        if not generation_config.return_dict_in_generate:
            return sequences
        return DFlashGenerateOutput(sequences=sequences, acceptance_lengths=list(stats.acceptance_lengths))
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        raise ValueError("DFlash generation needs a target cache; do not pass use_cache=False.")
    cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts

    if prompt_lookup is None:
        controller = block_size_controller(assistant_model, model, batch_size=1)
        generator = DFlashCandidateGenerator(assistant_model, model, generation_config, logits_processor, controller)
    else:
        max_nodes = assistant_model.config.block_size + prompt_lookup.num_tokens
        one_branch = bool(generation_config.do_sample) or not verifies_trees(model, cache, generation_config, max_nodes)
        budget = tree_budget(assistant_model, model, prompt_lookup.num_tokens, one_branch)
        generator = DFlashCandidateGenerator(
            assistant_model, model, generation_config, logits_processor, prompt_lookup=prompt_lookup, tree_budget=budget
        )
    # The drafter needs a few layers' hidden states; a caller asking for all of them gets all of them.
    overrides = (
        {"output_hidden_states": True} if generation_config.output_hidden_states else generator.model_kwargs_overrides
    )
    want_dict = generation_config.return_dict_in_generate
    scores = () if want_dict and generation_config.output_scores else None
    raw_logits = () if want_dict and generation_config.output_logits else None
    hidden_states = () if want_dict and generation_config.output_hidden_states else None

    outputs, is_first_iteration, num_matches, stopped = None, True, 0, False
    while not stopped:
        cur_len = input_ids.shape[1]
        candidate_ids, draft_scores = generator.get_candidates(
            input_ids,
            model_kwargs=model_kwargs,
            model_outputs=outputs,
            is_first_iteration=is_first_iteration,
            n_last_matches=num_matches,
        )
        num_drafts = candidate_ids.shape[1] - cur_len
        tree = generator.tree if generator.tree is not None and not generator.tree.is_chain else None

        # Verify: one target forward over [bonus, drafts] (the whole prompt on the first round).
        candidate_kwargs = _prepare_attention_mask(copy.copy(model_kwargs), candidate_ids.shape[1], False)
        candidate_kwargs = _prepare_token_type_ids(candidate_kwargs, candidate_ids.shape[1])
        if candidate_kwargs.get("position_ids") is not None and num_drafts > 0:
            new_length = num_drafts + candidate_kwargs["position_ids"].shape[-1]
            candidate_kwargs = _prepare_position_ids(candidate_kwargs, new_length, False)
        model_inputs = model.prepare_inputs_for_generation(
            candidate_ids,
            next_sequence_length=None if is_first_iteration else num_drafts + 1,
            is_first_iteration=is_first_iteration,
            **candidate_kwargs,
        )
        if "logits_to_keep" in model_inputs:
            model_inputs["logits_to_keep"] = num_drafts + 1
        model_inputs |= overrides
        if tree is not None:  # each node sees the context and its ancestors, at position root + depth
            model_inputs |= tree_inputs(model, model_inputs, tree, cur_len)
        outputs = model(**model_inputs)

        target_logits = outputs.logits[:, -num_drafts - 1 :].float()
        if tree is not None:  # greedy: the longest accepted path through the tree
            processed = process_tree_logits(logits_processor, input_ids, tree, target_logits)
            path = greedy_tree_path(tree, greedy_tokens(processed[0]))
            # From here on the round is laid out along the accepted path, as if it had been a chain.
            target_logits, processed = target_logits[:, path], processed[:, path]
            outputs.hidden_states = tuple(None if h is None else h[:, path] for h in outputs.hidden_states)
            new_tokens = greedy_tokens(processed)
        else:
            processed = process_block_logits(logits_processor, candidate_ids, target_logits, start=cur_len)
            if generation_config.do_sample:
                target_probs = processed.softmax(-1)
                if num_drafts:
                    new_tokens = speculative_sample(candidate_ids[:, cur_len:], draft_scores, target_probs)
                else:
                    new_tokens = torch.multinomial(target_probs[0], 1).view(1, -1)
            else:
                new_tokens = greedy_accept(candidate_ids[:, cur_len:], greedy_tokens(processed))

        # Commit token by token up to the first stop (EOS, stop string, length, time, custom).
        sequence = torch.cat([input_ids, new_tokens], dim=-1)
        kept, stopped = count_until_stop(stopping_criteria, sequence, cur_len, scores)
        input_ids = sequence[:, : cur_len + kept]
        num_matches = kept - 1
        if streamer is not None:
            streamer.put(input_ids[:, cur_len:].cpu())
        # The target cache holds cur_len + num_drafts tokens; drop those after the last accepted draft.
        if tree is not None:
            keep_tree_path(cache, tree.num_nodes, path[: num_matches + 1])
        else:
            cache.crop(-(num_drafts - num_matches))
        model_kwargs = model._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=kept
        )
        if not is_first_iteration or num_drafts:  # a round (hybrid: the prefill may verify n-gram drafts)
            generator.update_candidate_strategy(input_ids, processed, num_matches)

        if scores is not None:
            scores += tuple(processed[:, i] for i in range(kept))
        if raw_logits is not None:
            raw_logits += tuple(target_logits[:, i] for i in range(kept))
        if hidden_states is not None:
            hidden_states += split_hidden_states(outputs.hidden_states, cur_len, kept, is_first_iteration)
        is_first_iteration = False

    if streamer is not None:
        streamer.end()
    assistant_model.last_acceptance = generator.stats
    if not want_dict:
        return input_ids
    return DFlashGenerateOutput(
        sequences=input_ids,
        scores=scores,
        logits=raw_logits,
        hidden_states=hidden_states,
        **{CACHE_FIELD: cache},
        acceptance_lengths=list(generator.stats.acceptance_lengths),
    )


def verifies_trees(model, cache, generation_config, max_nodes: int) -> bool:
    """Whether the target can verify a draft tree in one forward: an attention that takes our 4D mask
    (eager, SDPA) and a DynamicCache whose layers are full attention, or sliding windows that generation
    cannot reach (the tree mask does not encode a window)."""
    if model.config._attn_implementation not in ("eager", "sdpa") or type(cache) is not DynamicCache:
        return False
    reachable = generation_config.max_length + max_nodes
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window <= reachable:
            return False
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            return False
    return True


def tree_inputs(model, model_inputs: dict, tree, cur_len: int) -> dict:
    """The 4D attention mask and per-node position ids of a tree forward over the last N candidates.

    The root (the bonus token) sits where a chain's first token would: the position the chain inputs give
    it, or the cache length; node i at root + depth(i). Context slots masked out by a 2D attention mask
    (padding) stay masked."""
    past = cur_len - 1
    device = model_inputs["input_ids"].device
    bias = tree_attention_bias(tree.parents, past, model.dtype, device)
    mask = model_inputs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and not bool(mask[0, :past].all()):
        bias[..., :past] = bias[..., :past].masked_fill(~mask[0, :past].bool().to(device), torch.finfo(model.dtype).min)
    positions = model_inputs.get("position_ids")
    root = int(positions[0, -tree.num_nodes]) if positions is not None else past
    return {"attention_mask": bias, "position_ids": (root + tree_depths(tree.parents)).to(device)[None]}


def split_hidden_states(layer_states: tuple, cur_len: int, kept: int, is_first_iteration: bool) -> tuple:
    """Per-token hidden states as plain decoding returns them: the prefill step covers the prompt and
    the first token; every later token gets its own (B, 1, H) slice per layer (after a prefill that
    verified drafts: those of the accepted drafts, which follow the prompt)."""
    if is_first_iteration:
        prefill = (tuple(h[:, :cur_len] for h in layer_states),)
        return prefill + tuple(tuple(h[:, t : t + 1] for h in layer_states) for t in range(cur_len, cur_len + kept - 1))
    return tuple(tuple(h[:, t : t + 1] for h in layer_states) for t in range(kept))
