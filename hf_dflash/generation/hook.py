"""The narrow hook into `generate`: route DFlash assistants to `dflash_decoding`.

`generate(assistant_model=...)` validates the pairing in `GenerationMixin._validate_generation_mode`
and dispatches to `GenerationMixin._assisted_decoding`. On import of `hf_dflash` we wrap both, once:
  - validation: a `DFlashDraftModel` assistant is checked by `check_pairing` first, so a mismatch
    gets our error naming the value and the fix (Transformers would call a vocab mismatch a
    "different tokenizers" problem), and by `check_dflash_generation_options`, the one place that
    refuses options DFlash cannot serve (prompt lookup, beam search, ...) instead of dropping them;
    a DFlash drafter built by other code (z-lab's class, a plain Qwen3Model from an official folder)
    is refused with the way to load ours, never run as a plain autoregressive assistant;
  - decoding: a `DFlashDraftModel` assistant runs our loop, unless the caller explicitly asked for
    Transformers' own loop with `speculation_type="dflash"`; with `prompt_lookup_num_tokens` beside it,
    our loop drafts with both (hybrid drafting, `decoding.py`).
Every other call (normal assistant models, prompt lookup, MTP, early exit, ...) reaches the
original methods unchanged, with the same arguments. Checked against Transformers 5.23.0 and 5.24.0.
"""

import functools

from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from ..checkpoints import looks_like_dflash_drafter
from ..modeling_dflash import DFlashDraftModel
from .decoding import dflash_decoding
from .pairing import check_pairing


def uses_dflash(assistant_model, generation_config) -> bool:
    """Whether our loop should serve this assisted-generation call."""
    return isinstance(assistant_model, DFlashDraftModel) and generation_config.speculation_type != "dflash"


# What each decoding mode that cannot use an assistant is called by the options that select it.
_MODE_OPTIONS = {
    GenerationMode.BEAM_SEARCH: "num_beams={num_beams} (beam search)",
    GenerationMode.BEAM_SAMPLE: "num_beams={num_beams} with do_sample=True (beam sampling)",
    GenerationMode.GROUP_BEAM_SEARCH: "num_beams={num_beams} with num_beam_groups (group beam search)",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "constraints / force_words_ids (constrained beam search)",
    GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha with top_k (contrastive search)",
    GenerationMode.DOLA_GENERATION: "dola_layers (DoLa decoding)",
}


def check_dflash_generation_options(generation_mode, generation_config) -> None:
    """Refuse `generate` options that a DFlash assistant cannot serve, instead of dropping them silently.

    - `prompt_lookup_num_tokens` with `speculation_type="dflash"`: Transformers' own loop would then run
      prompt lookup and never call the drafter (our loop, the default, drafts with both: hybrid drafting).
    - a decoding mode other than greedy / sampling (beam search, contrastive search, DoLa, ...):
      Transformers only warns and decodes without the drafter.
    - `guidance_scale` other than 1 (classifier-free guidance): its logits processor pairs every row with
      an unconditional row of one token per step, which a verified block does not have (Transformers
      dies inside it with a tensor-size error).
    """
    if generation_config.prompt_lookup_num_tokens is not None and generation_config.speculation_type == "dflash":
        raise ValueError(
            f"prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens} with speculation_type='dflash': "
            "Transformers' built-in loop would run prompt lookup and never use the DFlash drafter. Drop "
            "speculation_type to let hf_dflash verify the DFlash block and the n-gram drafts together (hybrid)."
        )
    guidance = generation_config.guidance_scale
    if guidance is not None and guidance != 1:
        raise ValueError(
            f"guidance_scale={guidance} (classifier-free guidance) cannot use a DFlash assistant_model: the guidance "
            "processor scores one token per step against an unconditional pass, and a speculative round verifies "
            "a block. Drop guidance_scale (or set it to 1), or decode without the assistant."
        )
    if generation_mode not in (GenerationMode.ASSISTED_GENERATION, GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        options = _MODE_OPTIONS.get(generation_mode, str(generation_mode)).format(num_beams=generation_config.num_beams)
        raise ValueError(
            f"{options} cannot use a DFlash assistant_model: speculative decoding serves greedy decoding and "
            "sampling only, and the drafter would be ignored. Drop the assistant or those options."
        )


def refuse_foreign_dflash_drafter(assistant_model) -> None:
    """A DFlash drafter object that is not our `DFlashDraftModel` would run as an ordinary autoregressive
    assistant (plain assisted decoding with a block-diffusion model): raise with the way to load ours."""
    if assistant_model is None or isinstance(assistant_model, DFlashDraftModel):
        return
    if looks_like_dflash_drafter(assistant_model):
        cls = type(assistant_model)
        source = getattr(getattr(assistant_model, "config", None), "name_or_path", "") or "PATH"
        raise ValueError(
            f"assistant_model is a DFlash drafter built by other code ({cls.__module__}.{cls.__name__}); "
            "Transformers would run it as a plain autoregressive assistant. Load it with "
            f"hf_dflash.load_drafter({source!r}), or convert this object with "
            "hf_dflash.drafter_from_model(assistant_model)."
        )


def install_generate_hook() -> None:
    """Wrap `_validate_generation_mode` and `_assisted_decoding` of `GenerationMixin` (idempotent)."""
    original_validate = GenerationMixin._validate_generation_mode
    original_decoding = GenerationMixin._assisted_decoding
    if getattr(original_decoding, "_hf_dflash_original", None) is not None:
        return

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant_model = generation_mode_kwargs.get("assistant_model")
        if isinstance(assistant_model, DFlashDraftModel):
            assistant_model.last_acceptance = None  # a refused call must not leave the previous call's stats
            check_dflash_generation_options(generation_mode, generation_config)
            check_pairing(self, assistant_model)
        elif generation_config.speculation_type != "dflash":  # Transformers' own DFlash loop: its assistants
            refuse_foreign_dflash_drafter(assistant_model)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    @functools.wraps(original_decoding)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
        if uses_dflash(kwargs.get("assistant_model"), generation_config):
            return dflash_decoding(
                self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs
            )
        return original_decoding(
            self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs
        )

    _validate_generation_mode._hf_dflash_original = original_validate
    _assisted_decoding._hf_dflash_original = original_decoding
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._assisted_decoding = _assisted_decoding
