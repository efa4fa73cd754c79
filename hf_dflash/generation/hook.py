"""The one narrow hook into `generate`: route DFlash assistants to `dflash_decoding`.

`generate(assistant_model=...)` dispatches to `GenerationMixin._assisted_decoding`. We wrap that
method once, on import of `hf_dflash`: when the assistant is a `DFlashDraftModel` (and the caller
did not explicitly ask for Transformers' own loop with `speculation_type="dflash"`), our loop runs;
every other call (normal assistant models, prompt lookup, MTP, early exit, ...) reaches the
original method unchanged, with the same arguments. Checked against Transformers 5.23.0 and 5.24.0.
"""

import functools

from transformers.generation.utils import GenerationMixin

from ..modeling_dflash import DFlashDraftModel
from .decoding import dflash_decoding


def uses_dflash(assistant_model, generation_config) -> bool:
    """Whether our loop should serve this assisted-generation call."""
    return isinstance(assistant_model, DFlashDraftModel) and generation_config.speculation_type != "dflash"


def install_generate_hook() -> None:
    """Wrap `GenerationMixin._assisted_decoding` (idempotent)."""
    original = GenerationMixin._assisted_decoding
    if getattr(original, "_hf_dflash_original", None) is not None:
        return

    @functools.wraps(original)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
        if uses_dflash(kwargs.get("assistant_model"), generation_config):
            return dflash_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)

    _assisted_decoding._hf_dflash_original = original
    GenerationMixin._assisted_decoding = _assisted_decoding
