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
original methods unchanged, with the same arguments.

Both methods are Transformers internals, so the hook is version-checked: it wraps them only on the
releases it was tested on (`TESTED_TRANSFORMERS`; `make test` runs the oldest and the newest) and only
when their parameters are the ones it expects. On any other release it wraps `generate` with a guard
that refuses a DFlash `assistant_model` with the reason and the alternative
(`custom_generate=<drafter folder or repo>`, which needs no patch), and passes every other call through.
Why not `generate(custom_generate=<callable>)` here too: Transformers then drops `streamer`, `tokenizer`
(stop strings) and `assistant_model` from the call, and validates the call as plain decoding.
"""

import functools
import inspect

import transformers
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


# Transformers releases (major.minor) whose generate internals the hook was tested on, and the parameters
# of the two methods it wraps there.
TESTED_TRANSFORMERS = ("5.23", "5.24", "5.25")
WRAPPED_PARAMETERS = {
    "_validate_generation_mode": ["self", "generation_mode", "generation_config", "generation_mode_kwargs"],
    "_assisted_decoding": [
        "self",
        "input_ids",
        "logits_processor",
        "stopping_criteria",
        "generation_config",
        "synced_gpus",
        "streamer",
        "inputs_tensor",
        "assistant_model",
        "assistant_tokenizer",
        "tokenizer",
        "model_kwargs",
    ],
}


def unsupported_reason(version: str) -> str | None:
    """Why the hook cannot route DFlash assistants on Transformers `version` (None: it can)."""
    release = ".".join(version.split(".")[:2])
    if release not in TESTED_TRANSFORMERS:
        return f"Transformers {version} is not a release it was tested on ({', '.join(TESTED_TRANSFORMERS)})"
    for name, expected in WRAPPED_PARAMETERS.items():
        found = list(inspect.signature(getattr(GenerationMixin, name)).parameters)
        if found != expected:
            return f"GenerationMixin.{name} of Transformers {version} takes {found}, not {expected}"
    return None


def install_generate_hook(version: str | None = None) -> None:
    """Wrap `_validate_generation_mode` and `_assisted_decoding` of `GenerationMixin` on a tested Transformers
    release (`version`: default the installed one); elsewhere install the refusing `generate` guard. Idempotent."""
    original_validate = GenerationMixin._validate_generation_mode
    original_decoding = GenerationMixin._assisted_decoding
    if getattr(original_decoding, "_hf_dflash_original", None) is not None:
        return
    if getattr(GenerationMixin.generate, "_hf_dflash_refusal", None) is not None:
        return
    reason = unsupported_reason(version or transformers.__version__)
    if reason is not None:
        install_refusal(reason)
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


def install_refusal(reason: str) -> None:
    """Wrap `GenerationMixin.generate` so that a DFlash `assistant_model` (without `speculation_type="dflash"`,
    Transformers' own loop) raises a ValueError saying `reason` and what to use instead."""
    original_generate = GenerationMixin.generate

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config")
        speculation = kwargs.get("speculation_type", getattr(config, "speculation_type", None))
        if isinstance(kwargs.get("assistant_model"), DFlashDraftModel) and speculation != "dflash":
            raise ValueError(
                f"hf_dflash cannot route generate(assistant_model=<DFlash drafter>): {reason}. Use "
                "generate(..., custom_generate=<the drafter's folder or Hub repo>, trust_remote_code=True), which "
                "runs DFlash without hf_dflash's hook, or install a tested release: "
                f"pip install 'transformers>={TESTED_TRANSFORMERS[0]},<{_next_release(TESTED_TRANSFORMERS[-1])}'."
            )
        return original_generate(self, *args, **kwargs)

    generate._hf_dflash_refusal = reason
    GenerationMixin.generate = generate


def _next_release(release: str) -> str:
    major, minor = release.split(".")
    return f"{major}.{int(minor) + 1}"
