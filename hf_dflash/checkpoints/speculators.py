"""vLLM speculators' DFlash layout ("speculators", load only): what can be translated, and named errors.

`speculators_model_type: "dflash"`: the decoder nested in `transformer_layer_config`;
`aux_hidden_state_layer_ids` index the target's `hidden_states` tuple (as vLLM's
`eagle_aux_hidden_state_layer_ids`: id a = output of decoder layer a - 1), so our `target_layer_ids`
are those ids minus one; `mask_token_id`, `block_size`, `draft_vocab_size` and
`sliding_window_non_causal` top-level. The weights carry the drafter keys plus copies of the
verifier's embedding / LM head and the vocabulary maps `t2d`/`d2t`, which this drafter borrows from
the target instead. The checkpoint does not record how many layers the verifier has.

`speculators_model_type: "dflash2"` (speculators `src/speculators/models/dflash2/`, marked experimental
there) adds `conv_kernel_size`, `conv_group_size`, `selector_rank` and `selector_top_k` top-level, defaults
`sliding_window_non_causal` to true, and its weights add `layers.{i}.{attention,mlp}_conv.*` and
`candidate_selector.*` under the names our DFlash2 drafter (and z-lab's layout) uses.

Loadable: full-vocabulary DFlash and DFlash2 with the plain projector and same-position labels. Refused,
each by name: Domino projectors, `sample_from_anchor`, `shift_label`, reduced draft vocabularies, a DFlash2
config without its four fields, DSpark / EAGLE and other algorithms.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..modeling_dflash import DFlashDraftModel
from ..modeling_dflash.configuration_dflash import (
    CHECKPOINT_REQUIRED_FIELDS,
    DFLASH2_FIELDS,
    OFFICIAL_DECODER_FIELDS,
    SILENT_FALLBACK,
    rope_parameters_from_config,
)
from .building import build_drafter
from .files import CONFIG_NAME, load_state_dict, read_config

SPECULATORS_TYPE_FIELD = "speculators_model_type"
# Weights a speculators checkpoint may carry that belong to the verifier (the target lends them here).
SPECULATORS_VERIFIER_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                               "verifier_norm.weight", "t2d", "d2t")  # fmt: skip
# The decoder fields a speculators config carries (the target's depth and width are not among them).
_SPECULATORS_DECODER_FIELDS = tuple(
    field for field in OFFICIAL_DECODER_FIELDS if field not in ("num_target_layers", "target_hidden_size")
)


def is_speculators_config(config: dict) -> bool:
    """Whether a config dict is in vLLM speculators' layout."""
    return SPECULATORS_TYPE_FIELD in config


def speculators_algorithm(config: dict, source: str) -> tuple[str, dict]:
    """(speculators_model_type, the DFlash2 fields: {} for DFlash) of a speculators config; a ValueError for
    another algorithm, or DFlash2 fields missing from a 'dflash2' config or present on a 'dflash' one."""
    algorithm = config.get(SPECULATORS_TYPE_FIELD)
    if algorithm == "dspark":
        raise ValueError(
            f"{source} is a speculators 'dspark' checkpoint (a DFlash variant with extra heads this drafter lacks); "
            "hf_dflash reads speculators' 'dflash' and 'dflash2' only. Serve it with vLLM."
        )
    if algorithm not in ("dflash", "dflash2"):
        raise ValueError(f"{source}: speculators_model_type {algorithm!r} is not a DFlash drafter.")
    dflash2 = {field: config.get(field) for field in DFLASH2_FIELDS} if algorithm == "dflash2" else {}
    missing = [field for field, value in dflash2.items() if value is None]
    stray = sorted(set(DFLASH2_FIELDS) & set(config)) if algorithm == "dflash" else []
    if missing or stray:
        problem = f"lacks {missing}" if missing else f"has the DFlash2 fields {stray}"
        raise ValueError(
            f"{source}: a speculators_model_type {algorithm!r} config that {problem}: a DFlash2 checkpoint says "
            "'dflash2' and carries all four (conv_kernel_size, conv_group_size, selector_rank, selector_top_k); "
            "fix the config."
        )
    return algorithm, dflash2


def dflash_kwargs_from_speculators(config: dict, source: str, num_target_layers: int | None = None) -> dict:
    """`DFlashConfig` keyword arguments from a speculators DFlash config dict.

    `num_target_layers` (the target's decoder layers) is required unless the config states it:
    speculators checkpoints name their verifier but not its depth. Raises a `ValueError` naming the
    field for anything this drafter cannot serve (see the module docstring).
    """
    algorithm, dflash2 = speculators_algorithm(config, source)
    refusals = {
        "projector_type": ("dflash", "a Domino correction head runs after the drafter, which this drafter lacks"),
        "sample_from_anchor": (False, "slot 0 drafts a token too; this loop treats it as the known anchor"),
        "shift_label": (False, "it was trained with next-token labels; DFlash predicts the same position"),
    }
    for field, (supported, why) in refusals.items():
        value = config.get(field, supported)
        if value not in (supported, None):
            raise ValueError(f"{source}: {field}={value!r} cannot be served here ({why}); only {supported!r} is.")
    layers = config.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ValueError(f"{source}: transformer_layer_config (the draft decoder) is missing or not an object.")
    vocab_size = layers.get("vocab_size", config.get("vocab_size"))
    if vocab_size is None:
        raise ValueError(
            f"{source}: transformer_layer_config.vocab_size is missing: it is the target's vocabulary size "
            "(its embedding rows); add it."
        )
    draft_vocab = config.get("draft_vocab_size", vocab_size)
    if draft_vocab != vocab_size:
        raise ValueError(
            f"{source}: draft_vocab_size={draft_vocab} is a reduced vocabulary (its own LM head and d2t map) "
            f"while the target has {vocab_size} rows; this drafter has no LM head of its own (its pruned draft "
            "vocabulary, draft_vocab_size, uses rows of the target's), so a trained reduced head cannot be carried over."
        )
    for field in CHECKPOINT_REQUIRED_FIELDS:
        speculators_name = "aux_hidden_state_layer_ids" if field == "target_layer_ids" else field
        if config.get(speculators_name) is None:
            raise ValueError(f"{source}: {speculators_name} is missing; {SILENT_FALLBACK}.")
    aux = list(config["aux_hidden_state_layer_ids"])
    if any(not isinstance(i, int) or i < 1 for i in aux):
        raise ValueError(
            f"{source}: aux_hidden_state_layer_ids {aux} must be >= 1: they index the target's hidden_states "
            "(0 is the embedding output, which DFlash never reads)."
        )
    depth = config.get("num_target_layers", num_target_layers)
    if depth is None:
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        raise ValueError(
            f"{source} does not record how many decoder layers its verifier "
            f"({verifier.get('name_or_path') or 'unnamed'}) has; pass num_target_layers=<the target's "
            "config.num_hidden_layers> (CLI: --num-target-layers N)."
        )

    kwargs = {field: layers[field] for field in _SPECULATORS_DECODER_FIELDS if layers.get(field) is not None}
    for field in ("layer_types", "sliding_window"):  # some exports repeat these top-level
        if config.get(field) is not None:
            kwargs[field] = config[field]
    kwargs.update(
        # the draft decoder's RoPE; some exports keep rope_theta top-level instead
        rope_parameters=speculators_rope(config, layers, source),
        block_size=config.get("block_size"),
        mask_token_id=config["mask_token_id"],
        target_layer_ids=[i - 1 for i in aux],
        num_target_layers=depth,
        # speculators' default: false for DFlash, true for DFlash2 (its config class says so)
        sliding_window_non_causal=bool(config.get("sliding_window_non_causal", algorithm == "dflash2")),
        tie_word_embeddings=False,
        **dflash2,
    )
    if config.get("target_hidden_size") is not None:
        kwargs["target_hidden_size"] = config["target_hidden_size"]
    if kwargs["block_size"] is None:
        raise ValueError(f"{source}: block_size is missing.")
    return kwargs


def speculators_rope(config: dict, layers: dict, source: str) -> dict:
    """The drafter's RoPE settings from `transformer_layer_config`, else from the top level (where some
    exports keep `rope_theta`); both given and different, or neither: a ValueError."""
    inner = layers.get("rope_parameters") is not None or layers.get("rope_theta") is not None
    outer = config.get("rope_parameters") is not None or config.get("rope_theta") is not None
    if inner and outer:
        mine, top = rope_parameters_from_config(layers, source), rope_parameters_from_config(config, source)
        if mine["rope_theta"] != top["rope_theta"]:
            raise ValueError(
                f"{source}: rope_theta {mine['rope_theta']} in transformer_layer_config disagrees with the top-level "
                f"{top['rope_theta']}; keep the one the drafter was trained with."
            )
    return rope_parameters_from_config(layers if inner or not outer else config, source)


def without_verifier_copies(state_dict: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """A speculators state dict without the verifier's embedding / LM head / norm copies and the
    (identity, full-vocabulary) token maps: the target lends those at generation time."""
    t2d = state_dict.get("t2d")
    if t2d is not None and not bool(t2d.bool().all()):
        raise ValueError(f"{source}: t2d maps only part of the vocabulary (a reduced draft vocabulary).")
    return {key: value for key, value in state_dict.items() if key not in SPECULATORS_VERIFIER_COPIES}


def load_speculators(
    path: str | os.PathLike,
    num_target_layers: int | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> DFlashDraftModel:
    """Load a vLLM speculators DFlash or DFlash2 checkpoint folder (`speculators_model_type: "dflash"` or
    `"dflash2"`) as a
    `DFlashDraftModel`. `num_target_layers` is the target's `config.num_hidden_layers` (speculators
    does not record it). What cannot be served raises a ValueError naming it (module docstring)."""
    folder = Path(path)
    source = str(folder / CONFIG_NAME)
    kwargs = dflash_kwargs_from_speculators(read_config(folder), source, num_target_layers)
    state_dict = without_verifier_copies(load_state_dict(folder), source)
    return build_drafter(kwargs, state_dict, str(folder), dtype, device, attn_implementation)


__all__ = [
    "SPECULATORS_TYPE_FIELD",
    "SPECULATORS_VERIFIER_COPIES",
    "dflash_kwargs_from_speculators",
    "is_speculators_config",
    "load_speculators",
    "without_verifier_copies",
]
