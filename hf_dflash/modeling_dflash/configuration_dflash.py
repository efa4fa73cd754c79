"""Configuration of a DFlash block-diffusion drafter.

Self-contained (imports only `transformers`): this file is copied verbatim into Hub repositories as
remote code, next to `modeling_dflash.py`.

Why the official-layout parsing (`dflash_kwargs_from_official` and its `_official_*` helpers) lives here and not
in a file of its own: Transformers' remote-code loading (5.23-5.25, `dynamic_module_utils`) does follow
`from .name import ...` to sibling files of the repo folder (it fetches them, and `save_pretrained` copies them;
`modeling_dflash.py` imports this file that way), so one file is not forced. But the split is not clean:
`DFlashConfig.from_dict` translates official config dicts (a Hub repo's config.json in that layout still loads
through this class), and the parser reads the fields the class checks too (the required checkpoint fields, the
DFlash2 fields, the neutral transforms, the RoPE reader). A separate file would import back from this one (a
cycle) or take the class's own fields with it, and every shipped folder (the exporter's, the official saver's,
`models/*/`, the card's file list) would carry a third remote-code file for about 250 lines.
"""

import difflib
import math
import numbers

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

LAYER_TYPES = ("full_attention", "sliding_attention")
# A checkpoint's config.json must state these: the class defaults describe Qwen3-8B, and a drafter
# run with another mask row or other target layers drafts garbage without any error.
CHECKPOINT_REQUIRED_FIELDS = ("mask_token_id", "target_layer_ids")
SILENT_FALLBACK = "engines and older loaders silently fall back to a default and acceptance collapses with no error"
# Sizes that must be integers >= 1: a 0 died in a ZeroDivisionError inside Transformers or our code, a negative
# one in a tensor allocation (num_key_value_heads and head_dim may be None: derived in __post_init__).
POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_target_layers",
    "target_hidden_size",
)
# The largest block a drafter may be configured with: acceptance decays along the block (the paper trains 16),
# and a block of 10**12 tokens was accepted and then allocated terabytes.
MAX_BLOCK_SIZE = 1024
# Official-layout (model_type "qwen3" + dflash_config) fields copied as they are.
OFFICIAL_DECODER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "layer_types",
    "sliding_window",
    "vocab_size",
    "num_target_layers",
    "target_hidden_size",
)
OFFICIAL_REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_target_layers",
)
# DFlash2 (z-lab's DFlash2DraftModel, docs/dflash2.md): a grouped dynamic convolution around both sublayers of
# every draft layer and a candidate selector over the top-K of each slot. All four are set, or none (DFlash).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# The official layout of a drafter with a pruned draft vocabulary holds `lm_head.weight` (draft_vocab_size, H): the
# target head's rows at the draft ids, which vLLM's DFlash head loads (it maps its logits through `d2t`). The drafter
# itself takes those rows from the target at run time, so a loader drops that weight, but only where the config marks
# it as the target's rows (a head trained on its own would be dropped silently otherwise).
DRAFT_HEAD_FIELD = "draft_lm_head"
DRAFT_HEAD_TARGET_ROWS = "target_rows"
# z-lab's embedding and logit transforms, at their no-op values: the block's embeddings are multiplied by
# input_embedding_scale; the logits by output_multiplier, then soft-capped (cap * tanh(logits / cap)).
NEUTRAL_TRANSFORMS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
# The keys an official DFlash2 dflash_config may hold (anything else is refused: it may change the maths).
OFFICIAL_DFLASH2_KEYS = {
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "sliding_window_non_causal",
    *DFLASH2_FIELDS,
    *NEUTRAL_TRANSFORMS,
}

# Keys a Hub-native config.json may carry besides `DFlashConfig`'s own fields and what Transformers' running
# `PreTrainedConfig` writes: keys of other Transformers versions, and the decoder keys of the Qwen3 config that the
# official layout is (a folder converted by hand keeps them). None of them changes the drafter.
STANDARD_CONFIG_KEYS = (
    "_name_or_path", "_commit_hash", "_attn_implementation", "architectures", "auto_map", "model_type",
    "transformers_version", "dtype", "torch_dtype", "use_cache", "quantization_config", "custom_pipelines",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "id2label", "label2id",
    "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "rope_theta", "rope_scaling", "use_sliding_window", "max_window_layers",
)  # fmt: skip


def check_known_keys(config_dict: dict, source: str = "config.json") -> None:
    """Raise a `ValueError` for a key of a Hub-native config dict that neither `DFlashConfig` nor Transformers
    knows (`STANDARD_CONFIG_KEYS`): a misspelt field (`block_size_poliy`) or one this version lacks would be
    ignored silently, and the drafter served otherwise than its config.json says. Names the key, the closest
    known one and the DFlash fields."""
    fields = [name for name in DFlashConfig.__annotations__ if not name.startswith("_")]
    known = {*fields, *STANDARD_CONFIG_KEYS, *PreTrainedConfig().to_dict(), *PreTrainedConfig.__annotations__}
    unknown = sorted(str(key) for key in config_dict if key not in known)
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], fields + sorted(set(known) - set(fields)), n=1, cutoff=0.6)
    raise ValueError(
        f"{source}: unknown key {unknown[0]!r}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + (f", and {unknown[1:]}" if len(unknown) > 1 else "")
        + f": the drafter's code would ignore it silently. A DFlash config.json holds the fields {fields} and Transformers' "
        "standard keys; correct or remove it (a newer hf_dflash may know it: update hf_dflash)."
    )


def default_target_layer_ids(num_target_layers: int, num_target_features: int) -> list[int]:
    """0-based target decoder layers whose outputs the drafter reads.

    One feature: the middle layer. Several: spread evenly from layer 1 to layer L-3, e.g.
    L=36, n=5 -> [1, 9, 17, 25, 33]; L=30 -> [1, 8, 14, 20, 27].
    """
    if num_target_features < 1:
        raise ValueError(f"num_target_features must be >= 1, got {num_target_features}.")
    if num_target_features == 1:
        return [num_target_layers // 2]
    if num_target_layers - 4 < num_target_features - 1:
        raise ValueError(
            f"A target with {num_target_layers} layers is too shallow to spread {num_target_features} "
            "distinct features over layers 1..L-3; pass target_layer_ids explicitly or fewer features."
        )
    step = (num_target_layers - 4) / (num_target_features - 1)
    return [round(1 + i * step) for i in range(num_target_features)]


def check_checkpoint_fields(config_dict: dict, source: str = "config.json") -> None:
    """Raise a `ValueError` when a Hub-format config dict lacks `mask_token_id`, `target_layer_ids` or its
    RoPE settings (`rope_parameters`, or an older `rope_theta`): each would fall back to a class default."""
    for field in CHECKPOINT_REQUIRED_FIELDS:
        if config_dict.get(field) is None:
            raise ValueError(
                f"{source} has no {field}: the class default would be used silently, and {SILENT_FALLBACK}. "
                f"Set {field} to the value the drafter was trained with."
            )
    if config_dict.get("rope_parameters") is None and config_dict.get("rope_theta") is None:
        raise ValueError(
            f"{source} has no rope_parameters (nor rope_theta): the default base differs per format (1e6, 1e5, "
            '1e4) and a wrong one costs acceptance with no error. Set rope_parameters: {"rope_type": "default", '
            '"rope_theta": <the base the drafter was trained with, normally its target\'s>}.'
        )


def rope_parameters_from_config(config: dict, source: str = "config.json", fallback: dict | None = None) -> dict:
    """rope_parameters from a Transformers >= 5 config dict, or from older rope_theta + rope_scaling;
    without a RoPE base there, `fallback`'s (a section that keeps it elsewhere), else a ValueError: the
    formats' defaults differ (1e4, 1e5, 1e6) and a wrong base costs acceptance silently."""
    if isinstance(config.get("rope_parameters"), dict):
        rope = dict(config["rope_parameters"])
        if "full_attention" in rope and isinstance(rope["full_attention"], dict):
            rope = dict(rope["full_attention"])
    else:
        rope = dict(config.get("rope_scaling") or {})
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None and fallback is not None:
        theta = rope_parameters_from_config(fallback, source).get("rope_theta")
    if theta is None:
        raise ValueError(
            f"{source}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta): the default base differs "
            "per format (1e4, 1e5, 1e6) and a wrong one costs acceptance with no error. Add the base the drafter "
            "was trained with (normally its target's rope_theta)."
        )
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"{source}: rope_theta={theta!r} must be a positive number.")
    rope["rope_theta"] = float(theta)
    return rope


def strict_int(value, name: str, low: int | None = None) -> int:
    """`value` when it is an integer (not a bool, a float or a string) of at least `low`; else a ValueError
    naming `name`: config values are never coerced (a float truncated, `true` read as 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer, got {type(value).__name__}.")
    if low is not None and value < low:
        raise ValueError(f"{name}={value!r} must be >= {low}.")
    return int(value)


def _check_positive_ints(config, names) -> None:
    """Each of `names` set on `config` (None skipped) is an integer >= 1; else a ValueError naming it."""
    for name in names:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"{name}={value!r} must be an integer >= 1; set it to the value the drafter was built with "
                "(its config.json)."
            )


def _check_real(value, name: str, low: float, low_inclusive: bool, fix: str, high: float | None = None) -> None:
    """`value` is a finite real number above `low` (or equal, when `low_inclusive`) and at most `high`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number; {fix}.")
    if value < low or (value == low and not low_inclusive) or (high is not None and value > high):
        bounds = f"{'>=' if low_inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise ValueError(f"{name}={value!r} must be {bounds}; {fix}.")


def _rope_thetas(rope) -> list:
    """The RoPE bases in `rope_parameters` (one dict, or one per layer type)."""
    if not isinstance(rope, dict):
        return []
    if all(isinstance(value, dict) for value in rope.values()) and rope:
        return [theta for value in rope.values() for theta in _rope_thetas(value)]
    return [rope["rope_theta"]] if "rope_theta" in rope else []


def _official_sliding_semantics(config: dict, dflash: dict, source: str) -> bool:
    """`sliding_window_non_causal` of an official config: ours (in dflash_config), or z-lab's `is_causal`
    (None: sliding layers causal, False: every layer bidirectional); default False (SpecForge)."""
    ours = dflash.get("sliding_window_non_causal", config.get("sliding_window_non_causal"))
    is_causal = config.get("is_causal")
    if is_causal is True:
        raise ValueError(
            f"{source}: is_causal=true makes every draft layer causal, full-attention ones included; DFlash "
            "drafters are bidirectional inside the block, so this checkpoint cannot be served here."
        )
    if is_causal is False and ours is False:
        raise ValueError(
            f"{source}: is_causal=false (bidirectional sliding layers) contradicts "
            "sliding_window_non_causal=false; keep one of them."
        )
    return bool(ours) or is_causal is False


def _transform_value(name: str, value):
    """A transform's value with "unset" spelled as its no-op (a softcap of 0 or None: none)."""
    if name == "final_logit_softcapping":
        return value or None
    return NEUTRAL_TRANSFORMS[name] if value is None else value


def _official_transforms(config: dict, dflash: dict, source: str) -> dict:
    """The embedding/logit transforms of an official config as `DFlashConfig` kwargs (no-op ones left out).
    They belong in dflash_config (where vLLM reads them; z-lab also reads the top level): a non-neutral
    top-level value that dflash_config does not repeat is refused, since engines would disagree."""
    kwargs = {}
    for name, neutral in NEUTRAL_TRANSFORMS.items():
        nested, top = _transform_value(name, dflash.get(name)), _transform_value(name, config.get(name))
        if top != neutral and top != nested:
            raise ValueError(
                f"{source}: the top-level {name}={top!r} differs from dflash_config.{name}={nested!r}; vLLM reads "
                f"only dflash_config and z-lab reads it first, so engines would draft from different logits. "
                f"Put the value the drafter was trained with in dflash_config.{name} (and drop the top-level one)."
            )
        if nested != neutral:
            kwargs[name] = nested
    return kwargs


def _official_dflash2_fields(config: dict, dflash: dict, source: str) -> dict:
    """The DFlash2 fields of an official config (`DFlash2DraftModel`, in dflash_config) as `DFlashConfig`
    kwargs; {} for a DFlash checkpoint. Partial, misplaced, unknown or contradicted fields raise."""
    architectures = config.get("architectures") or []
    present = [field for field in DFLASH2_FIELDS if dflash.get(field) is not None]
    top_level = [field for field in DFLASH2_FIELDS if field not in present and config.get(field) is not None]
    if top_level:
        raise ValueError(
            f"{source}: {top_level} are top-level, but engines (vLLM, z-lab) read dflash_config.{top_level[0]}; "
            "move the DFlash2 fields into dflash_config."
        )
    if not present and DFLASH2_ARCHITECTURE not in architectures:
        return {}
    missing = [field for field in DFLASH2_FIELDS if field not in present]
    if missing:
        why = f"dflash_config.{present[0]}" if present else f"architectures {architectures}"
        raise ValueError(
            f"{source} is a DFlash2 checkpoint ({why}) but dflash_config lacks {missing}; set them to the values "
            "the drafter was trained with (z-lab's: conv_kernel_size 2, conv_group_size 16, selector_rank 256, "
            "selector_top_k 16; the weights' shapes show conv_kernel_size and selector_rank)."
        )
    if architectures and DFLASH2_ARCHITECTURE not in architectures:
        raise ValueError(
            f"{source}: dflash_config has the DFlash2 fields but architectures={architectures}; engines pick the "
            f"model class by architectures and would drop the DFlash2 weights. Set architectures to "
            f'["{DFLASH2_ARCHITECTURE}"].'
        )
    unknown = sorted(set(dflash) - OFFICIAL_DFLASH2_KEYS)
    if unknown:
        raise ValueError(
            f"{source}: dflash_config.{unknown[0]} is not a DFlash2 field hf_dflash knows ({sorted(OFFICIAL_DFLASH2_KEYS)}); "
            "a field that changes the drafter's maths would be ignored silently. Remove it, or update hf_dflash."
        )
    return {field: dflash[field] for field in DFLASH2_FIELDS}


def _official_block_size(config: dict, dflash: dict, source: str):
    """block_size, top-level or in dflash_config (both: they must agree)."""
    top, nested = config.get("block_size"), dflash.get("block_size")
    if top is not None and nested is not None and top != nested:
        raise ValueError(
            f"{source}: block_size={top!r} (top-level) disagrees with dflash_config.block_size={nested!r}; "
            "engines read one or the other, so fix the wrong one."
        )
    block_size = top if top is not None else nested
    if block_size is None:
        raise ValueError(f"{source}: block_size is missing (neither top-level nor in dflash_config).")
    return block_size


def dflash_kwargs_from_official(config: dict, source: str = "config.json") -> dict:
    """`DFlashConfig` keyword arguments from an official / SpecForge / z-lab config dict
    (`model_type: "qwen3"`, `dflash_config: {mask_token_id, target_layer_ids[, block_size]}`), DFlash or
    DFlash2 (`architectures: ["DFlash2DraftModel"]`, `dflash_config` adds `conv_kernel_size`,
    `conv_group_size`, `selector_rank`, `selector_top_k` and optionally the logit/embedding transforms).

    Raises a `ValueError` naming the field for a missing, misplaced or conflicting field.
    """
    model_type = config.get("model_type")
    if model_type != "qwen3":
        raise ValueError(f"{source}: official DFlash checkpoints have model_type 'qwen3', got {model_type!r}.")
    dflash = config.get("dflash_config")
    if dflash is None:
        dflash = {}
    if not isinstance(dflash, dict):
        raise ValueError(f"{source}: dflash_config must be a JSON object, got {dflash!r}.")
    dflash2 = _official_dflash2_fields(config, dflash, source)
    transforms = _official_transforms(config, dflash, source)
    for field in CHECKPOINT_REQUIRED_FIELDS:
        if dflash.get(field) is None:
            found = ""
            if config.get(field) is not None:
                found = f" (a top-level {field}={config[field]!r} exists, but engines read dflash_config.{field})"
            raise ValueError(
                f"{source}: dflash_config.{field} is missing{found}; {SILENT_FALLBACK}. "
                f"Set dflash_config.{field} to the value the drafter was trained with."
            )
    block_size = _official_block_size(config, dflash, source)
    missing = [field for field in OFFICIAL_REQUIRED_FIELDS if config.get(field) is None]
    if missing:
        raise ValueError(f"{source}: required field(s) {missing} missing from the config.")

    kwargs = {field: config[field] for field in OFFICIAL_DECODER_FIELDS if config.get(field) is not None}
    kwargs.update(
        rope_parameters=rope_parameters_from_config(config, source),
        block_size=block_size,
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=dflash["target_layer_ids"],
        sliding_window_non_causal=_official_sliding_semantics(config, dflash, source),
        tie_word_embeddings=False,
        **dflash2,
        **transforms,
    )
    if config.get("draft_vocab_size") is not None:  # EAGLE-3 / speculators convention (d2t/t2d in the weights)
        kwargs["draft_vocab_size"] = config["draft_vocab_size"]
    return kwargs


def choose_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """Pick an embedding row to use as the MASK token when the caller gives none.

    The mask embedding must not look like real content, so we prefer, in order:
    1. the first embedding row the tokenizer can never produce (Qwen3 pads its embedding past the
       tokenizer: 151669 for a 151669-token tokenizer), when the embedding has such rows;
    2. a special token that is neither BOS/EOS/PAD/UNK nor used by the chat template (e.g.
       SmolLM2's `<repo_name>`), so it never occurs in chat data;
    3. without a tokenizer, the last embedding row: by convention an unused padding row (Qwen) or a
       reserved special token (Llama 3). Pass `tokenizer=` (or `mask_token_id=`) to be sure.
    A real token equal to the mask id would only lower acceptance, never break losslessness.
    """
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    for token_id in sorted(tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder)):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token_id not in reserved and token_id < vocab_size and token not in template:
            return token_id
    return vocab_size - 1


def _check_block_and_sizes(config) -> None:
    """Sizes >= 1, a block the positions can hold, an activation Transformers knows."""
    _check_positive_ints(config, POSITIVE_INT_FIELDS)
    if not isinstance(config.block_size, int) or isinstance(config.block_size, bool) or config.block_size < 2:
        raise ValueError(f"block_size must be an int >= 2 (anchor + at least one draft), got {config.block_size!r}.")
    if config.block_size > min(MAX_BLOCK_SIZE, config.max_position_embeddings):
        raise ValueError(
            f"block_size={config.block_size} is larger than "
            + (
                f"max_position_embeddings={config.max_position_embeddings} (the positions the model can hold)"
                if config.max_position_embeddings < MAX_BLOCK_SIZE
                else f"{MAX_BLOCK_SIZE}, the largest block hf_dflash serves or trains"
            )
            + "; set block_size to the block the drafter was trained with (16 in the paper)."
        )
    if config.hidden_act not in ACT2FN:
        raise ValueError(
            f"hidden_act={config.hidden_act!r} is not an activation Transformers knows "
            "(transformers.activations.ACT2FN); set the drafter's own, e.g. 'silu' (Qwen3), 'gelu_pytorch_tanh' "
            "or 'relu'."
        )


def _check_numerics(config) -> None:
    """Finite, positive norms and RoPE bases; dropout and initialiser ranges; sliding window and bias flags."""
    _check_real(config.rms_norm_eps, "rms_norm_eps", 0.0, False, "RMSNorm divides by sqrt(mean + eps) (Qwen3: 1e-6)")
    for theta in _rope_thetas(config.rope_parameters):
        _check_real(theta, "rope_theta", 0.0, False, "set the RoPE base the drafter was trained with")
    _check_real(config.attention_dropout, "attention_dropout", 0.0, True, "a probability (0.0 for inference)", 1.0)
    _check_real(config.initializer_range, "initializer_range", 0.0, True, "the std of the initial weights (0.02)")
    if config.sliding_window is not None and (
        isinstance(config.sliding_window, bool)
        or not isinstance(config.sliding_window, numbers.Integral)
        or config.sliding_window < 0
    ):
        raise ValueError(
            f"sliding_window={config.sliding_window!r} must be None or an integer >= 0 (tokens; 0 or None: no window)."
        )
    if not isinstance(config.attention_bias, bool):
        raise ValueError(f"attention_bias must be true or false, got {config.attention_bias!r}.")


def _check_target_fields(config) -> None:
    """The target layers read and the mask token, against the target."""
    ids = config.target_layer_ids
    if not ids:
        raise ValueError("target_layer_ids is empty; give at least one 0-based target layer index.")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} contains duplicates.")
    bad = [i for i in ids if not 0 <= i < config.num_target_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {ids} has {bad} outside [0, num_target_layers={config.num_target_layers}): "
            "ids are 0-based target decoder layers (hidden_states[i + 1])."
        )
    if config.mask_token_id is None:
        raise ValueError(
            "mask_token_id is missing: set it to an unused row of the target's embedding "
            "(see choose_mask_token_id); without it acceptance collapses silently."
        )
    strict_int(config.mask_token_id, "mask_token_id")
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is outside the target embedding [0, vocab_size={config.vocab_size})."
        )


def _check_layout(config) -> None:
    """Heads that group, one known type per layer, a draft vocabulary within the target's, a block size policy the
    block allows, windows set where layers slide."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}."
        )
    if len(config.layer_types) != config.num_hidden_layers or set(config.layer_types) - set(LAYER_TYPES):
        raise ValueError(
            f"layer_types {config.layer_types} must list one of {LAYER_TYPES} for each of the "
            f"{config.num_hidden_layers} layers."
        )
    if config.draft_vocab_size is not None and (
        not isinstance(config.draft_vocab_size, int)
        or isinstance(config.draft_vocab_size, bool)
        or not 1 <= config.draft_vocab_size <= config.vocab_size
    ):
        raise ValueError(
            f"draft_vocab_size={config.draft_vocab_size!r} must be an int in [1, vocab_size={config.vocab_size}] "
            "(or None for the whole vocabulary)."
        )
    policy = config.block_size_policy
    fixed = isinstance(policy, int) and not isinstance(policy, bool) and 2 <= policy <= config.block_size
    if policy is not None and policy not in ("adaptive", "confidence") and not fixed:
        raise ValueError(
            f"block_size_policy={policy!r} must be None (the trained block size), 'adaptive', 'confidence', or an "
            f"int k with 2 <= k <= block_size={config.block_size}."
        )
    if "sliding_attention" in config.layer_types and not config.sliding_window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set.")
    if not isinstance(config.sliding_window_non_causal, bool):
        raise ValueError(f"sliding_window_non_causal must be true or false, got {config.sliding_window_non_causal!r}.")


def _check_dflash2(config) -> None:
    """The four DFlash2 fields all None (DFlash) or all integers >= 1 that fit the drafter: groups that split
    hidden_size, taps within the block, a top-K within the vocabulary, the whole vocabulary drafted."""
    present = [name for name in DFLASH2_FIELDS if getattr(config, name) is not None]
    if not present:
        return
    missing = [name for name in DFLASH2_FIELDS if name not in present]
    if missing:
        raise ValueError(
            f"{present[0]} is set but {missing} are not: a DFlash2 drafter needs all of {list(DFLASH2_FIELDS)} "
            "(z-lab's: 2, 16, 256, 16), a DFlash drafter none of them."
        )
    for name in DFLASH2_FIELDS:
        strict_int(getattr(config, name), name, 1)
    if config.hidden_size % config.conv_group_size:
        raise ValueError(
            f"conv_group_size={config.conv_group_size} must divide hidden_size={config.hidden_size}: the "
            "convolution shares one dynamic kernel per group of conv_group_size channels."
        )
    if config.conv_kernel_size > config.block_size:
        raise ValueError(
            f"conv_kernel_size={config.conv_kernel_size} must be <= block_size={config.block_size}: the "
            "convolution never reads across the draft block."
        )
    if config.selector_top_k > config.vocab_size:
        raise ValueError(f"selector_top_k={config.selector_top_k} must be <= vocab_size={config.vocab_size}.")
    if config.draft_vocab_size is not None and config.draft_vocab_size < config.selector_top_k:
        raise ValueError(
            f"draft_vocab_size={config.draft_vocab_size} < selector_top_k={config.selector_top_k}: the selector "
            "ranks selector_top_k candidates among the draft ids; enlarge the draft vocabulary or lower top-K."
        )


def _check_transforms(config) -> None:
    """input_embedding_scale and output_multiplier finite and > 0; final_logit_softcapping None or > 0."""
    fix = "1.0 is the no-op; set the value the drafter was trained with"
    _check_real(config.input_embedding_scale, "input_embedding_scale", 0.0, False, fix)
    _check_real(config.output_multiplier, "output_multiplier", 0.0, False, fix)
    if config.final_logit_softcapping is not None:
        _check_real(
            config.final_logit_softcapping,
            "final_logit_softcapping",
            0.0,
            False,
            "None is the no-op (cap * tanh(logits / cap) otherwise)",
        )


class DFlashConfig(PreTrainedConfig):
    r"""Configuration of a [`DFlashDraftModel`].

    Decoder fields follow Qwen3. DFlash fields:
        block_size: tokens drafted per round, including the anchor slot (16 in the paper).
        target_layer_ids: 0-based target decoder layers whose outputs are fused into the context.
        mask_token_id: target embedding row used for the masked block slots.
        num_target_layers: number of decoder layers of the target.
        vocab_size: the target's embedding rows (the drafter borrows its embedding and LM head).
        target_hidden_size: the target's hidden size (defaults to `hidden_size`).
        sliding_window_non_causal: the semantics of `sliding_attention` layers. False (default,
            SpecForge): causal inside the block, windowed on the context. True (vLLM speculators'
            `sliding_window_non_causal`, z-lab's `is_causal: false`): bidirectional inside the
            block, still windowed on the context. Full-attention layers are always bidirectional.
        draft_vocab_size: None (default) drafts over the target's whole vocabulary; N drafts over N
            target token ids only (the `d2t`/`t2d` buffers of the model say which, as in EAGLE-3 and
            vLLM speculators), computing N rows of the target's LM head instead of all of them.
        block_size_policy: the block length per round the drafter's publisher recommends (what hf_dflash's
            loop uses unless `drafter.block_size_policy` is set): None (the trained `block_size`),
            "adaptive" (chosen each round from acceptance and the measured cost of this machine),
            "confidence" (the whole block drafted, the prefix of its drafts worth verifying by the drafter's
            own probabilities and the measured cost), or a fixed k with 2 <= k <= block_size. Other loaders
            ignore it.
        conv_kernel_size, conv_group_size, selector_rank, selector_top_k: DFlash2 (docs/dflash2.md), all
            set or all None (DFlash): taps of the grouped dynamic convolution around each sublayer, channels
            per dynamic kernel, rank of the candidate selector's codebooks, candidates it ranks per slot.
        input_embedding_scale, output_multiplier, final_logit_softcapping: z-lab's transforms (no-ops by
            default): block embeddings x scale; logits x multiplier, then cap * tanh(logits / cap).
    Fields at their DFlash/no-op values are not written to config.json.

    A config.json must state `mask_token_id` and `target_layer_ids` (`from_dict` raises otherwise);
    one in the official layout (`model_type: "qwen3"` + `dflash_config`) is translated.
    The defaults describe a 5-layer drafter for Qwen3-8B (36 layers, hidden 4096).
    """

    model_type = "dflash"
    # Serialise every field so the Hub config.json is explicit (no silent defaults for ids).
    has_no_defaults_at_init = True

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = 151669
    num_target_layers: int = 36
    target_hidden_size: int | None = None
    sliding_window_non_causal: bool = False
    draft_vocab_size: int | None = None
    block_size_policy: str | int | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self, **kwargs):
        # the sizes the defaults below divide by or repeat, before they are used
        _check_positive_ints(self, ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_target_layers"))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.rope_parameters is None and "rope_theta" not in kwargs and "rope_scaling" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, 5)
        if not isinstance(self.target_layer_ids, (list, tuple)):  # a string would be split into characters
            raise ValueError(
                f"target_layer_ids={self.target_layer_ids!r} must be a list of 0-based target layer integers."
            )
        self.target_layer_ids = [strict_int(i, "target_layer_ids item", 0) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.validate_dflash()

    def validate_dflash(self) -> None:
        """Raise a `ValueError` naming the first inconsistent or out-of-range field (and the fix)."""
        for check in (
            _check_block_and_sizes,
            _check_numerics,
            _check_target_fields,
            _check_layout,
            _check_dflash2,
            _check_transforms,
        ):
            check(self)

    @property
    def is_dflash2(self) -> bool:
        """Whether the drafter has DFlash2's convolutions and candidate selector."""
        return self.conv_kernel_size is not None

    def to_dict(self) -> dict:
        """`PreTrainedConfig.to_dict` without the DFlash2 fields and transforms left at their DFlash/no-op
        values, so a DFlash config.json is byte for byte what it was before DFlash2."""
        output = super().to_dict()
        for name, unset in {**dict.fromkeys(DFLASH2_FIELDS), **NEUTRAL_TRANSFORMS}.items():
            if name in output and output[name] == unset:
                del output[name]
        return output

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "DFlashConfig":
        """`PreTrainedConfig.from_dict` (what `from_pretrained` and `AutoConfig` call) that refuses a
        Hub-format dict with an unknown key or without `mask_token_id`/`target_layer_ids`, and translates the
        official layout."""
        if config_dict.get("model_type") == "qwen3" and "dflash_config" in config_dict:
            # DRAFT_HEAD_FIELD: read (and removed) by DFlashDraftModel.from_pretrained, which checks the weights
            carried = {
                key: config_dict[key] for key in ("dtype", "torch_dtype", DRAFT_HEAD_FIELD) if key in config_dict
            }
            config_dict = {**carried, **dflash_kwargs_from_official(config_dict)}
        else:
            check_known_keys(config_dict)
            check_checkpoint_fields({**config_dict, **{k: v for k, v in kwargs.items() if v is not None}})
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_target_config(
        cls,
        target_config: PreTrainedConfig,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        num_target_features: int | None = None,
        mask_token_id: int | None = None,
        tokenizer=None,
        target_layer_ids: list[int] | None = None,
        **overrides,
    ) -> "DFlashConfig":
        """Derive a drafter config from the target's: sizes, heads, RoPE, vocab and default layer ids.

        `target_layer_ids`, when given, wins over the default spread of `num_target_features`
        (default 5) features, for a target of any depth; giving both with different counts is an error.
        `tokenizer` (optional) lets `choose_mask_token_id` pick a provably unused mask row.
        `overrides` replace any other derived field (e.g. `intermediate_size`).
        """
        text = target_config.get_text_config()
        rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10_000.0})
        if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3): the drafter's layers are global
            rope = dict(rope["full_attention"])
        num_heads = text.num_attention_heads
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(text.num_hidden_layers, num_target_features or 5)
        elif num_target_features is not None and num_target_features != len(target_layer_ids):
            raise ValueError(
                f"num_target_features={num_target_features} contradicts target_layer_ids={list(target_layer_ids)} "
                f"({len(target_layer_ids)} features); pass only target_layer_ids."
            )
        fields = {
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            "max_position_embeddings": text.max_position_embeddings,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_parameters": rope,
            "block_size": block_size,
            "num_target_layers": text.num_hidden_layers,
            "target_hidden_size": text.hidden_size,
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": mask_token_id
            if mask_token_id is not None
            else choose_mask_token_id(text.vocab_size, tokenizer),
        }
        fields.update(overrides)
        return cls(**fields)


__all__ = [
    "DFlashConfig",
    "check_checkpoint_fields",
    "check_known_keys",
    "choose_mask_token_id",
    "default_target_layer_ids",
    "dflash_kwargs_from_official",
    "rope_parameters_from_config",
]
