"""DFlash speculative decoding with plain Transformers: the drafter repository's `custom_generate/generate.py`.

Self-contained (imports only `torch` and `transformers`): `hf-dflash export` copies this file verbatim into
every drafter folder, so that without the hf-dflash package

    out = target.generate(**inputs, custom_generate="org/drafter", trust_remote_code=True, max_new_tokens=128)

loads the drafter of that repository (remote code, the target's dtype and device) and decodes with it. A
drafter already loaded can be passed as `assistant_model=` instead. Transformers' `generate` still prepares
everything (generation config, logits processors and warpers, stopping criteria, cache, streamer): this
file hands it a decoding method (`custom_generate` accepts a callable) that runs one DFlash chain per round:

    draft    one drafter pass over [last token, MASK x (block_size - 1)] drafts block_size - 1 tokens
             (never past max_length), argmax (greedy) or sampled from the drafter's processed distribution;
             a DFlash2 drafter's candidate selector walks the block's top-K candidates instead
    verify   ONE target forward over [last token, drafts] with the hidden states the drafter reads
    accept   the longest prefix the target agrees with + the target's own next token (greedy), or
             Leviathan rejection sampling (`speculative_sample`): output distributed as the target samples
    commit   token by token up to the first stopping criterion (EOS, max_length, stop strings, custom),
             so a stop inside an accepted block ends the output exactly where plain decoding does
    rollback crop the target cache to the committed tokens; their features become the drafter's context

Greedy output is token-identical to plain greedy decoding (in fp32). Batch size 1; options this loop does
not serve (beam search, several prompts, attentions or hidden states in the output, ...) raise a ValueError.
The hf-dflash package runs a fuller loop (batches, trees, hybrid drafting) for `assistant_model=drafter`;
the package imports `drafter_cache`, `drafter_pass`, `accepted_lengths` and `speculative_sample` from this file,
so both run one drafter pass on one kind of cache and share the acceptance rules.
"""

import copy
import inspect

import torch
from transformers import AutoModel, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import TemperatureLogitsWarper
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

# Hub options of `generate(custom_generate=..., revision=...)` that also apply to loading the drafter.
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
# Transformers 5.24 renamed the output's (and the model kwargs') `past_key_values` to `cache`.
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
_DRAFTERS = {}  # (repo, dtype, device) -> drafter, so repeated calls load it once


def accepted_lengths(draft_tokens: torch.LongTensor, target_tokens: torch.LongTensor) -> torch.LongTensor:
    """How many drafts each row keeps: the longest prefix the target agrees with (the one acceptance rule).

    draft_tokens (B, k); target_tokens (B, >= k): the target's choice after each prefix. Returns (B,) in 0..k.
    """
    mismatch = (draft_tokens != target_tokens[:, : draft_tokens.shape[1]]).int()
    return (mismatch.cumsum(-1) == 0).sum(-1)


def speculative_sample(
    draft_tokens: torch.LongTensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.LongTensor:
    """Leviathan et al. rejection sampling: the output is distributed exactly as the target samples.

    draft_tokens (1, k) were sampled from draft_probs (1, k, V); target_probs (1, k+1, V).
    Draft i is kept with probability min(1, p_i/q_i); the first rejected slot is resampled from
    normalise(max(p_i - q_i, 0)); if all are kept, a bonus token is sampled from p_k.
    Returns (1, n+1).
    """
    k = draft_tokens.shape[1]
    index = draft_tokens[0]
    p = target_probs[0, torch.arange(k), index]
    q = draft_probs[0, torch.arange(k), index]
    uniform = torch.rand(k, device=p.device, generator=generator)
    rejected = (uniform * q >= p).nonzero()
    if rejected.numel() == 0:
        bonus = torch.multinomial(target_probs[0, k], 1, generator=generator)
        return torch.cat([draft_tokens[0], bonus])[None]
    n = int(rejected[0, 0])
    residual = (target_probs[0, n] - draft_probs[0, n]).clamp_min(0)
    total = residual.sum()
    # q == p at this slot up to rounding: the residual vanishes, p itself is the right distribution
    residual = residual / total if total > 0 else target_probs[0, n]
    correction = torch.multinomial(residual, 1, generator=generator)
    return torch.cat([draft_tokens[0, :n], correction])[None]


def drafter_cache(config) -> DynamicCache:
    """The drafter's context cache for a drafter `config`: a `DynamicCache` whose sliding-window layers record
    past states. Every pass appends its block and `drafter_pass` crops it again; Transformers (5.23-5.25) crops a
    sliding layer that has reached its window only when it records the past, as the target's cache does."""
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


def drafter_pass(
    drafter,
    embedding,
    cache,
    bonus: torch.LongTensor,
    context: torch.Tensor,
    position_ids: torch.LongTensor,
    block_length: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """ONE drafter pass over the block `[bonus, MASK x (block_length - 1)]` after the new `context` (the one pass
    every DFlash loop of this project runs: this file's, the hf-dflash package's and its cost timing).

    bonus (B,) each row's last committed token; context (B, C, n*Ht) target features of the tokens committed
    since the last pass; position_ids (B, C + block_length); attention_mask (B, T + block_length) over the
    drafter cache's slots, the new context and the block (None: every slot valid). `cache` keeps the context
    only (the block is cropped: the next block replaces it). Returns (B, block_length - 1, H), the outputs of
    the mask slots.
    """
    block_ids = torch.full(
        (bonus.shape[0], block_length), drafter.config.mask_token_id, dtype=bonus.dtype, device=bonus.device
    )
    block_ids[:, 0] = bonus
    hidden = drafter(
        noise_embeds=embedding(block_ids),
        context_hidden_states=context,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cache=cache,
    ).last_hidden_state
    cache.crop(-block_length)
    return hidden[:, 1:]


def generate(model, assistant_model=None, streamer=None, **kwargs):
    """`model.generate(**kwargs)` decoded with the DFlash drafter of the repository this file came from (or
    `assistant_model`, a DFlash drafter already loaded). Returns what `generate` returns."""
    hub_kwargs = {name: kwargs.pop(name) for name in HUB_KWARGS if name in kwargs}
    drafter = assistant_model if assistant_model is not None else load_repo_drafter(model, _calling_repo(), hub_kwargs)
    if not callable(getattr(drafter, "draft_logits", None)) or getattr(drafter.config, "model_type", None) != "dflash":
        raise ValueError(
            f"custom_generate DFlash needs a DFlash drafter (model_type 'dflash'), got {type(drafter).__name__}."
        )
    kwargs = _with_stop_string_criteria(model, kwargs)
    # `generate` passes a callable's own keyword arguments only (not `streamer`): ours carry the drafter and
    # the streamer; `streamer=` still lets `generate` stream the prompt, as it does before any decoding.
    return type(model).generate(
        model,
        custom_generate=dflash_decoding,
        dflash_drafter=drafter,
        dflash_streamer=streamer,
        streamer=streamer,
        **kwargs,
    )


def _calling_repo() -> str:
    """The `custom_generate` repository or folder of the `generate` call that loaded this file."""
    frame = inspect.currentframe()
    while frame is not None:
        repo = frame.f_locals.get("custom_generate") if frame.f_code.co_name == "generate" else None
        if isinstance(repo, str):
            return repo
        frame = frame.f_back
    raise ValueError(
        "Could not find which repository this custom_generate came from: pass the drafter as "
        "assistant_model=AutoModel.from_pretrained(REPO, trust_remote_code=True, dtype=target.dtype)."
    )


def load_repo_drafter(model, repo: str, hub_kwargs: dict):
    """The drafter of `repo` in the target's dtype and on its device (loaded once per process)."""
    key = (repo, model.dtype, str(model.device), tuple(sorted(hub_kwargs.items())))
    if key not in _DRAFTERS:
        # The caller trusted this repository's code (custom_generate needs trust_remote_code=True): the
        # drafter's modeling code comes from the same repository.
        drafter = AutoModel.from_pretrained(repo, trust_remote_code=True, dtype=model.dtype, **hub_kwargs)
        _DRAFTERS[key] = drafter.to(model.device).eval()
    return _DRAFTERS[key]


def _with_stop_string_criteria(model, kwargs: dict) -> dict:
    """`generate` drops `tokenizer` before calling a custom decoding method, so stop strings (argument or
    generation config) become a `StopStringCriteria` here."""
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is None and config.stop_strings is not None:
        stop_strings, config = config.stop_strings, copy.deepcopy(config)
        config.stop_strings = None
        kwargs["generation_config"] = config
    if stop_strings is None:
        return kwargs
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("stop_strings need the target's tokenizer: pass tokenizer=... to generate.")
    criteria = list(kwargs.pop("stopping_criteria", None) or [])
    kwargs["stopping_criteria"] = StoppingCriteriaList([*criteria, StopStringCriteria(tokenizer, stop_strings)])
    return kwargs


def check_options(model, drafter, input_ids, generation_config, model_kwargs) -> None:
    """Refuse, with the reason, what this loop does not serve."""
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError("prompt_lookup_num_tokens is not supported by DFlash custom_generate; drop it.")
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"DFlash custom_generate serves greedy decoding and sampling, not {mode.value}.")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"DFlash custom_generate decodes one sequence at a time, got {input_ids.shape[0]} "
            "(prompts x num_return_sequences); call generate once per prompt, or use the hf-dflash package."
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("DFlash custom_generate does not support padding in the prompt; pass it unpadded.")
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            "DFlash custom_generate returns sequences, scores and logits only; drop output_attentions "
            "and output_hidden_states."
        )
    if model.config.is_encoder_decoder:
        raise ValueError("DFlash drafters serve decoder-only targets; this target is encoder-decoder.")
    text_config = model.config.get_text_config()
    expected = {
        "vocab_size": text_config.vocab_size,
        "num_target_layers": text_config.num_hidden_layers,
        "target_hidden_size": text_config.hidden_size,
    }
    for name, value in expected.items():
        if getattr(drafter.config, name) != value:
            raise ValueError(
                f"This drafter was made for another target: its {name} is "
                f"{getattr(drafter.config, name)}, the target's {value}."
            )


def keep_cache(cache, length: int) -> None:
    """Drop the cache slots after the first `length` (`crop` takes the number to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def target_inputs(model, sequence, drafts, first: bool, cache: dict, model_kwargs: dict) -> dict:
    """The verification forward's inputs: the prefill reads the prompt, as plain decoding's first step does;
    later rounds read [last committed token, drafts] after the cache, which holds every earlier token."""
    if first:
        inputs = model.prepare_inputs_for_generation(sequence, is_first_iteration=True, **model_kwargs)
    else:
        start = sequence.shape[1]
        inputs = model.prepare_inputs_for_generation(
            torch.cat([sequence[:, -1:], drafts], 1),
            attention_mask=sequence.new_ones(1, start + drafts.shape[1]),
            position_ids=torch.arange(start - 1, start + drafts.shape[1], device=sequence.device)[None],
            use_cache=True,
            **cache,
        )
    if "logits_to_keep" in inputs:
        inputs["logits_to_keep"] = drafts.shape[1] + 1
    return inputs


def judge(logits_processor, sequence, drafts, draft_probs, logits, do_sample: bool):
    """(processed logits (1, d+1, V), the tokens to commit (1, n+1)): the target's logits after each prefix
    [sequence, drafts[:t]] processed as plain decoding does, then greedy acceptance or rejection sampling."""
    start = sequence.shape[1]
    extended = torch.cat([sequence, drafts], 1)
    processed = torch.stack(
        [logits_processor(extended[:, : start + t], logits[:, t]) for t in range(logits.shape[1])], 1
    )
    if do_sample and drafts.shape[1]:
        return processed, speculative_sample(drafts, draft_probs, processed.softmax(-1))
    if do_sample:
        return processed, torch.multinomial(processed[:, 0].softmax(-1), 1)
    target_tokens = processed.max(-1).indices
    return processed, target_tokens[:, : int(accepted_lengths(drafts, target_tokens)[0]) + 1]


def draft(drafter, lm_head, hidden, sequence, logits_processor, do_sample: bool):
    """(drafts (1, d), the distributions they were sampled from (1, d, V) or None) from the drafter's outputs.

    A DFlash2 drafter drafts by its candidate selector's walk from the last token: greedy, the best path;
    sampling, each slot drawn from softmax(S / T) over its candidates given the token drawn before it, and
    that distribution (0 off the candidates) is the slot's q for the rejection test."""
    selector = getattr(drafter, "candidate_selector", None)
    if not do_sample and selector is None:
        return drafter.greedy_draft_tokens(hidden, lm_head), None
    logits = drafter.draft_logits(hidden, lm_head).float()
    if not do_sample:
        return selector.walk(hidden, logits, sequence[:, -1])[0].tokens, None
    # drafts only need *a* distribution they are drawn from: each slot processed with the committed prefix
    logits = torch.stack([logits_processor(sequence, logits[:, t]) for t in range(logits.shape[1])], 1)
    if selector is None:
        probs = logits.softmax(-1)
        return torch.multinomial(probs[0], 1).T, probs
    temperature = sampling_temperature(logits_processor)
    path, candidate_ids = selector.walk(hidden, logits, sequence[:, -1], sampled_choice, temperature)
    probs = logits.new_zeros(logits.shape).scatter(-1, candidate_ids, path.scores.softmax(-1))
    return path.tokens, probs


def sampled_choice(scores: torch.Tensor) -> torch.LongTensor:
    """(..., K) scores -> (...) an index drawn from softmax(scores) (the selector walk's sampling choice)."""
    return torch.multinomial(scores.softmax(-1).flatten(0, -2), 1).view(scores.shape[:-1])


def sampling_temperature(logits_processor) -> float:
    """The temperature among the call's logits processors (1.0 without a temperature warper)."""
    warpers = [p for p in logits_processor or () if isinstance(p, TemperatureLogitsWarper)]
    return float(warpers[0].temperature) if warpers else 1.0


@torch.no_grad()
def dflash_decoding(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    dflash_drafter=None,
    dflash_streamer=None,
    **model_kwargs,
):
    """The decoding method `generate` calls (see the module docstring); returns sequences (1, L) or a
    `GenerateDecoderOnlyOutput` with `return_dict_in_generate=True`."""
    drafter, streamer = dflash_drafter, dflash_streamer if dflash_streamer is not None else streamer
    check_options(model, drafter, input_ids, generation_config, model_kwargs)
    cache_key = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(cache_key)
    if cache is None:
        raise ValueError("DFlash generation needs the target's cache; do not pass use_cache=False.")
    cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts
    config = drafter.config
    layer_ids, block_size = list(config.target_layer_ids), config.block_size
    embedding, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    drafter_state = drafter_cache(config)
    do_sample, max_length = bool(generation_config.do_sample), generation_config.max_length
    want_dict = generation_config.return_dict_in_generate
    scores = () if want_dict and generation_config.output_scores else None
    raw_logits = () if want_dict and generation_config.output_logits else None

    sequence, context, drafter_seen, drafts, draft_probs = input_ids, None, 0, input_ids[:, :0], None
    while True:
        start = sequence.shape[1]
        inputs = target_inputs(model, sequence, drafts, context is None, {cache_key: cache}, model_kwargs)
        inputs["output_hidden_states"] = [i + 1 for i in layer_ids]
        outputs = model(**inputs)
        logits = outputs.logits[:, -drafts.shape[1] - 1 :].float()
        processed, new_tokens = judge(logits_processor, sequence, drafts, draft_probs, logits, do_sample)
        # commit token by token up to the first stop
        stopped = False
        for t in range(new_tokens.shape[1]):
            sequence = torch.cat([sequence, new_tokens[:, t : t + 1]], 1)
            scores = scores + (processed[:, t],) if scores is not None else None
            raw_logits = raw_logits + (logits[:, t],) if raw_logits is not None else None
            if bool(stopping_criteria(sequence, scores).all()):
                stopped = True
                break
        if streamer is not None:
            streamer.put(sequence[:, start:].cpu())
        if stopped or sequence.shape[1] >= max_length:
            break
        # rollback: keep the cache of every committed token but the last; the drafter reads their features
        keep_cache(cache, sequence.shape[1] - 1)
        rows = sequence.shape[1] - 1 - (start - 1 if context is not None else 0)
        context = torch.cat([outputs.hidden_states[i + 1][:, :rows] for i in layer_ids], -1)
        # draft: [last token, MASK x (block_size - 1)] at positions len - 1 ..., after the new context
        num_drafts = min(block_size - 1, max_length - sequence.shape[1] - 1)
        if num_drafts <= 0:
            drafts, draft_probs = sequence[:, :0], None
            continue
        positions = torch.arange(drafter_seen, sequence.shape[1] - 1 + block_size, device=sequence.device)[None]
        hidden = drafter_pass(drafter, embedding, drafter_state, sequence[:, -1], context, positions, block_size)
        drafter_seen = sequence.shape[1] - 1
        drafts, draft_probs = draft(drafter, lm_head, hidden[:, :num_drafts], sequence, logits_processor, do_sample)

    if streamer is not None:
        streamer.end()
    keep_cache(cache, sequence.shape[1] - 1)  # as plain decoding leaves it: every token but the last
    if not want_dict:
        return sequence
    return GenerateDecoderOnlyOutput(sequences=sequence, scores=scores, logits=raw_logits, **{CACHE_FIELD: cache})
