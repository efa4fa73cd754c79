"""vLLM speculators' DFlash layout ("speculators"): reading it, writing it (`save_speculators`), named errors.

`speculators_model_type: "dflash"`: the decoder nested in `transformer_layer_config`;
`aux_hidden_state_layer_ids` index the target's `hidden_states` tuple (as vLLM's
`eagle_aux_hidden_state_layer_ids`: id a = output of decoder layer a - 1), so our `target_layer_ids`
are those ids minus one; `mask_token_id`, `block_size`, `draft_vocab_size` and
`sliding_window_non_causal` top-level. The weights carry the drafter keys plus copies of the
verifier's embedding / LM head and the vocabulary maps `t2d`/`d2t`, which this drafter borrows from
the target instead. The checkpoint does not record how many layers the verifier has (ours add
`num_target_layers`, which speculators keeps as an extra field).

`speculators_model_type: "dflash2"` (speculators `src/speculators/models/dflash2/`, marked experimental
there) adds `conv_kernel_size`, `conv_group_size`, `selector_rank` and `selector_top_k` top-level, defaults
`sliding_window_non_causal` to true, and its weights add `layers.{i}.{attention,mlp}_conv.*` and
`candidate_selector.*` under the names our DFlash2 drafter (and z-lab's layout) uses.

Written as speculators 0.9.0 saves it: no embedding (its loader reads the embedding, LM head and final norm
from `speculators_config.verifier.name_or_path`, so the export names the target there); a pruned draft
vocabulary (DFlash only: speculators' DFlash2 needs the whole vocabulary) adds `lm_head.weight`, the target
head's rows at the draft ids, beside `t2d`/`d2t` (draft index i is target id i + d2t[i], as ours), and
`draft_lm_head: "target_rows"` in the config, so our reader drops those rows again (the target lends them).

Loadable: DFlash and DFlash2 with the plain projector and same-position labels, the whole vocabulary or a draft
vocabulary marked as the target's rows. Refused, each by name: Domino projectors, `sample_from_anchor`,
`shift_label`, other reduced draft vocabularies, a DFlash2 config without its four fields, DSpark / EAGLE and
other algorithms.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from ..modeling_dflash import DFlashConfig, DFlashDraftModel
from ..modeling_dflash.configuration_dflash import (
    CHECKPOINT_REQUIRED_FIELDS,
    DFLASH2_ARCHITECTURE,
    DFLASH2_FIELDS,
    DRAFT_HEAD_FIELD,
    DRAFT_HEAD_TARGET_ROWS,
    NEUTRAL_TRANSFORMS,
    OFFICIAL_DECODER_FIELDS,
    SILENT_FALLBACK,
    rope_parameters_from_config,
)
from .building import build_drafter
from .files import CONFIG_NAME, WEIGHTS_NAME, as_dtype, dtype_name, load_state_dict, read_config
from .official import draft_head_rows

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
    if draft_vocab != vocab_size and config.get(DRAFT_HEAD_FIELD) != DRAFT_HEAD_TARGET_ROWS:
        raise ValueError(
            f"{source}: draft_vocab_size={draft_vocab} is a reduced vocabulary (its own LM head and d2t map) "
            f"while the target has {vocab_size} rows; this drafter has no LM head of its own (its pruned draft "
            "vocabulary, draft_vocab_size, uses rows of the target's), so a trained reduced head cannot be carried "
            f"over. If lm_head.weight is the target head's rows at the draft ids, say so: {DRAFT_HEAD_FIELD}: "
            f'"{DRAFT_HEAD_TARGET_ROWS}" (save_speculators writes it).'
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
        draft_vocab_size=draft_vocab if draft_vocab != vocab_size else None,
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


def without_verifier_copies(
    state_dict: dict[str, torch.Tensor], source: str, config: dict | None = None
) -> dict[str, torch.Tensor]:
    """A speculators state dict without the verifier's embedding / LM head / norm copies and, for the whole
    vocabulary, the identity token maps: the target lends those at generation time. With a draft vocabulary
    (`config`'s draft_vocab_size below its vocab_size, marked as the target's rows) `t2d`/`d2t` stay and
    `lm_head.weight` must be (draft_vocab_size, hidden_size)."""
    layers = (config or {}).get("transformer_layer_config") or {}
    vocab_size = layers.get("vocab_size", (config or {}).get("vocab_size"))
    draft_vocab = (config or {}).get("draft_vocab_size", vocab_size)
    copies = set(SPECULATORS_VERIFIER_COPIES)
    if draft_vocab != vocab_size:
        head = state_dict.get("lm_head.weight")
        expected = [draft_vocab, layers.get("hidden_size")]
        if head is None or list(head.shape) != expected:
            found = "none" if head is None else list(head.shape)
            raise ValueError(
                f"{source}: a draft vocabulary needs lm_head.weight of shape [draft_vocab_size, hidden_size] = "
                f"{expected} (the target head's rows at the draft ids); the weights hold {found}."
            )
        copies -= {"t2d", "d2t"}
    else:
        t2d = state_dict.get("t2d")
        if t2d is not None and not bool(t2d.bool().all()):
            raise ValueError(f"{source}: t2d maps only part of the vocabulary (a reduced draft vocabulary).")
    return {key: value for key, value in state_dict.items() if key not in copies}


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
    config = read_config(folder)
    kwargs = dflash_kwargs_from_speculators(config, source, num_target_layers)
    state_dict = without_verifier_copies(load_state_dict(folder), source, config)
    return build_drafter(kwargs, state_dict, str(folder), dtype, device, attn_implementation)


# The speculators release whose layout `save_speculators` writes (and whose `SpeculatorModel.from_pretrained`
# tests/test_engines.py runs on it).
SPECULATORS_RELEASE = "0.9.0"


def speculators_refusal(config: DFlashConfig) -> str | None:
    """Why speculators 0.9.0 cannot run this drafter as it runs here (None: it can)."""
    if config.is_dflash2 and config.draft_vocab_size is not None:
        return (
            f"it is DFlash2 with a pruned draft vocabulary (draft_vocab_size={config.draft_vocab_size}), and "
            "speculators' DFlash2 requires the whole verifier vocabulary (its DFlash2DraftModel raises otherwise); "
            "expand it (--expand-vocabulary, or expand_draft_vocabulary(model) first: its drafts then change, "
            "docs/serving.md), train it with draft_vocab_size None, or serve it with this package"
        )
    if config.target_hidden_size != config.hidden_size:
        return (
            f"target_hidden_size={config.target_hidden_size} differs from hidden_size={config.hidden_size}, and "
            "speculators sizes fc's input as len(aux_hidden_state_layer_ids) x hidden_size"
        )
    if "sliding_attention" in config.layer_types:
        return (
            "it has sliding-window layers: speculators windows the context from the anchor (keys at positions "
            ">= anchor - sliding_window) where this drafter windows it from each query (query - key < "
            "sliding_window), so it would draft from other keys; use full-attention layers"
        )
    changed = {name: getattr(config, name) for name, neutral in NEUTRAL_TRANSFORMS.items()
               if getattr(config, name) != neutral}  # fmt: skip
    if changed:
        return f"speculators has no {sorted(changed)} transform (this drafter sets {changed})"
    return None


def speculators_layer_config(config: DFlashConfig) -> dict:
    """`transformer_layer_config`: the draft decoder as a Qwen3 config (vocab_size: the target's)."""
    layers = {"model_type": "qwen3"}
    layers.update({field: getattr(config, field) for field in _SPECULATORS_DECODER_FIELDS})
    layers.update(rope_parameters=dict(config.rope_parameters), tie_word_embeddings=False, use_sliding_window=False)
    return layers


def speculators_config_dict(config: DFlashConfig, dtype: torch.dtype, verifier: str, architectures=()) -> dict:
    """The config.json speculators 0.9.0's `SpeculatorModelConfig` reads for this drafter (weights in `dtype`);
    `verifier` (a Hub id or a local folder) is where its loader takes the embedding, LM head and final norm."""
    algorithm = "dflash2" if config.is_dflash2 else "dflash"
    out = {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_RELEASE,
        "architectures": [DFLASH2_ARCHITECTURE if config.is_dflash2 else "DFlashSpeculator"],
        "transformer_layer_config": speculators_layer_config(config),
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": config.sliding_window_non_causal,
        "sample_from_anchor": False,
        "num_target_layers": config.num_target_layers,  # an extra field: speculators does not record it
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)},
        },
        "dtype": dtype_name(dtype),
        "transformers_version": transformers.__version__,
    }
    if config.is_dflash2:
        out.update({field: getattr(config, field) for field in DFLASH2_FIELDS})
    if config.draft_vocab_size is not None:
        out[DRAFT_HEAD_FIELD] = DRAFT_HEAD_TARGET_ROWS
    return out


def save_speculators(
    model: DFlashDraftModel,
    out_dir: str | os.PathLike,
    verifier: str,
    dtype: str | torch.dtype | None = None,
    target_lm_head=None,
    verifier_architectures=(),
) -> Path:
    """Write vLLM speculators' layout (as speculators 0.9.0 saves a DFlash / DFlash2 drafter): `config.json` and
    `model.safetensors` with the drafter's weights; `SpeculatorModel.from_pretrained(out_dir)` loads it.

    `verifier`: the target's Hub id or local folder, written as `speculators_config.verifier.name_or_path`
    (speculators reads the embedding, LM head and final norm from there). A pruned draft vocabulary also needs
    `target_lm_head` (the target, its LM head or the (V, H) weight): its rows at the draft ids are written as
    `lm_head.weight` beside `t2d`/`d2t`. `dtype` casts the weights. What speculators cannot run as this package
    does raises a ValueError naming why, before anything is written. Returns the output folder."""
    refusal = speculators_refusal(model.config)
    if refusal is not None:
        raise ValueError(f"This drafter has no speculators layout: {refusal}.")
    if not verifier:
        raise ValueError(
            "The speculators layout names its verifier: speculators loads the embedding, LM head and final norm "
            "from it. Pass verifier=<the target's Hub id or local folder> (CLI: --target NAME_OR_FOLDER)."
        )
    head = draft_head_rows(model, target_lm_head) if model.config.draft_vocab_size is not None else None
    target_dtype = as_dtype(dtype) or model.dtype
    weights = dict(model.state_dict(), **({"lm_head.weight": head} if head is not None else {}))
    state_dict = {
        key: tensor.detach().to("cpu", target_dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        for key, tensor in weights.items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = speculators_config_dict(model.config, target_dtype, str(verifier), verifier_architectures)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


__all__ = [
    "SPECULATORS_RELEASE",
    "SPECULATORS_TYPE_FIELD",
    "SPECULATORS_VERIFIER_COPIES",
    "dflash_kwargs_from_speculators",
    "is_speculators_config",
    "load_speculators",
    "save_speculators",
    "speculators_config_dict",
    "speculators_refusal",
    "without_verifier_copies",
]
