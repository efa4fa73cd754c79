"""The narrow hook into `generate`: route DFlash assistants to `dflash_decoding`.

`generate(assistant_model=...)` validates the pairing in `GenerationMixin._validate_generation_mode`
and dispatches to `GenerationMixin._assisted_decoding`. On import of `hf_dflash` we wrap both, once:
  - validation: a `DFlashDraftModel` assistant is checked by `check_pairing` first, so a mismatch
    gets our error naming the value and the fix (Transformers would call a vocab mismatch a
    "different tokenizers" problem);
  - decoding: a `DFlashDraftModel` assistant runs our loop, unless the caller explicitly asked for
    Transformers' own loop with `speculation_type="dflash"`; with `prompt_lookup_num_tokens` beside it,
    our loop drafts with both (hybrid drafting, `decoding.py`).
Every other call (normal assistant models, prompt lookup, MTP, early exit, ...) reaches the
original methods unchanged, with the same arguments. Checked against Transformers 5.23.0 and 5.24.0.
"""

import functools

from transformers.generation.utils import GenerationMixin

from ..modeling_dflash import DFlashDraftModel
from .decoding import dflash_decoding
from .pairing import check_pairing


def uses_dflash(assistant_model, generation_config) -> bool:
    """Whether our loop should serve this assisted-generation call."""
    return isinstance(assistant_model, DFlashDraftModel) and generation_config.speculation_type != "dflash"


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
            check_pairing(self, assistant_model)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    @functools.wraps(original_decoding)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
        if uses_dflash(kwargs.get("assistant_model"), generation_config):
            return dflash_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)
        return original_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)

    _validate_generation_mode._hf_dflash_original = original_validate
    _assisted_decoding._hf_dflash_original = original_decoding
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._assisted_decoding = _assisted_decoding
