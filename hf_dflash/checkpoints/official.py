"""The official / SpecForge / vLLM / SGLang format ("official").

`config.json` with `model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`, Qwen3 decoder fields,
`block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids, block_size}`;
the same weight keys as the Hub-native format. DFlash2 (z-lab's layout, docs/dflash2.md):
`architectures: ["DFlash2DraftModel"]`, `dflash_config` adds `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k` (and any non-neutral logit/embedding transform), and the weights add
`layers.{i}.{attention,mlp}_conv.*` and `candidate_selector.*` (bare codebook names). Like z-lab's releases it carries
`auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}` and the two remote-code files, so
`AutoModel.from_pretrained(dir, trust_remote_code=True)` gives the drafter while `AutoConfig` (and
engines reading the config through Transformers) still sees a `Qwen3Config`.

A pruned draft vocabulary (`draft_vocab_size` N): `d2t` (N,) and `t2d` (V,) as EAGLE-3 stores them, and
`lm_head.weight` (N, H) = the target head's rows at `arange(N) + d2t`. vLLM (0.32, `qwen3_dflash.py`) builds the
drafter's head with N rows from that weight and scatters its N logits to `arange(N) + d2t`; without the weight it
shares the target's whole head and keeps its first N rows, so every slot scores the wrong token and every draft is
rejected. The drafter itself takes those rows from the target at run time: `draft_lm_head: "target_rows"` in the
config says the weight is a copy, and loaders drop it only then.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from ..modeling_dflash import DFlashConfig, DFlashDraftModel, configuration_dflash
from ..modeling_dflash.configuration_dflash import (
    DFLASH2_ARCHITECTURE,
    DFLASH2_FIELDS,
    DRAFT_HEAD_FIELD,
    DRAFT_HEAD_TARGET_ROWS,
    NEUTRAL_TRANSFORMS,
    OFFICIAL_DECODER_FIELDS,
    dflash_kwargs_from_official,
)
from .building import build_drafter
from .files import CONFIG_NAME, REMOTE_CODE_FILES, WEIGHTS_NAME, as_dtype, dtype_name, load_state_dict, read_config

OFFICIAL_AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def official_config_dict(config: DFlashConfig, dtype: torch.dtype) -> dict:
    """The official-format config.json contents for a DFlashConfig whose weights are `dtype`."""
    rope = dict(config.rope_parameters)
    rope_theta = rope.get("rope_theta", 10_000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    # Older engines read rope_theta + rope_scaling (None for plain RoPE).
    rope_scaling = None if scaling in ({}, {"rope_type": "default"}) else scaling
    architecture = DFLASH2_ARCHITECTURE if config.is_dflash2 else "DFlashDraftModel"
    out = {"architectures": [architecture], "model_type": "qwen3", "auto_map": dict(OFFICIAL_AUTO_MAP)}
    out.update({field: getattr(config, field) for field in OFFICIAL_DECODER_FIELDS})
    dflash = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
    }
    if config.is_dflash2:
        dflash.update({field: getattr(config, field) for field in DFLASH2_FIELDS})
    dflash.update(
        {
            name: getattr(config, name)
            for name, neutral in NEUTRAL_TRANSFORMS.items()
            if getattr(config, name) != neutral
        }
    )
    if "sliding_attention" in config.layer_types:  # say which semantics the sliding layers were trained with
        if not config.is_dflash2:  # z-lab's DFlash2 configs say it with is_causal only
            dflash["sliding_window_non_causal"] = config.sliding_window_non_causal
        if config.sliding_window_non_causal:
            out["is_causal"] = False  # z-lab's field for the same semantics
    out.update(
        {
            "layer_types": list(config.layer_types),
            "use_sliding_window": "sliding_attention" in config.layer_types,
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope,
            "tie_word_embeddings": False,
            "block_size": config.block_size,
            "dflash_config": dflash,
            "dtype": dtype_name(dtype),
            "torch_dtype": dtype_name(dtype),
            "transformers_version": transformers.__version__,
        }
    )
    if config.draft_vocab_size is not None:
        # As EAGLE-3 and vLLM speculators store a draft vocabulary: `draft_vocab_size` in the config and
        # the d2t (draft index -> target id offset) / t2d (target id -> in the draft vocab) buffers in
        # the weights, beside `lm_head.weight`, the target head's rows at the draft ids (vLLM's DFlash head).
        out["draft_vocab_size"] = config.draft_vocab_size
        out[DRAFT_HEAD_FIELD] = DRAFT_HEAD_TARGET_ROWS
    return out


def target_head_weight(target) -> torch.Tensor:
    """The (V, H) LM-head weight of `target`: a causal LM (its output embeddings), a Linear, or the weight itself."""
    if isinstance(target, torch.Tensor):
        return target
    if hasattr(target, "get_output_embeddings"):
        target = target.get_output_embeddings()
    weight = getattr(target, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"target_lm_head must be a causal LM, its LM head or the head's weight, got {type(target)}.")
    return weight


def draft_head_rows(model: DFlashDraftModel, target_lm_head) -> torch.Tensor:
    """The target head's rows at the drafter's draft ids, (draft_vocab_size, H): the official `lm_head.weight`.

    Raises ValueError without a head (the engines would score the wrong rows) or with one of another shape."""
    config = model.config
    if target_lm_head is None:
        raise ValueError(
            f"This drafter has a pruned draft vocabulary (draft_vocab_size={config.draft_vocab_size}); its official "
            "layout holds the target head's rows at the draft ids as lm_head.weight, which vLLM's DFlash head loads "
            "(without it vLLM scores the first rows of the target's head and rejects every draft). Give the target: "
            "save_official(..., target_lm_head=target) or, on the command line, --target NAME_OR_FOLDER."
        )
    weight = target_head_weight(target_lm_head).detach()
    expected = [config.vocab_size, config.hidden_size]
    if list(weight.shape) != expected:
        raise ValueError(
            f"target_lm_head has shape {list(weight.shape)}, but this drafter's target head is {expected} "
            "(vocab_size, hidden_size): it is another model's head."
        )
    return weight[model.draft_token_ids.to(weight.device)]


def official_head(model: DFlashDraftModel, target_lm_head=None) -> torch.Tensor | None:
    """The official `lm_head.weight` of `model` (None without a draft vocabulary), or the ValueError that
    `save_official` raises: checked before anything is written."""
    if model.config.is_dflash2 and model.config.draft_vocab_size is not None:
        raise ValueError(
            f"A DFlash2 drafter with draft_vocab_size={model.config.draft_vocab_size} has no official layout as "
            "trained: DFlash2 readers (vLLM, speculators) rank the whole vocabulary. Expand it (--expand-vocabulary, "
            "or expand_draft_vocabulary(model) before save_official): it then drafts, and its selector ranks, over "
            "the target's whole vocabulary, so its drafts change (docs/serving.md gives the measured acceptance). Or "
            "save it Hub-native (save_hub / hf-dflash export), or train it with draft_vocab_size None."
        )
    return draft_head_rows(model, target_lm_head) if model.config.draft_vocab_size is not None else None


def save_official(
    model: DFlashDraftModel,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    target_lm_head=None,
) -> Path:
    """Write the official / SpecForge / vLLM / SGLang format: `config.json` (`model_type: "qwen3"`,
    `architectures: ["DFlashDraftModel"]` or `["DFlash2DraftModel"]`, `dflash_config`, `auto_map` for AutoModel only),
    `model.safetensors` with the same weight keys as the Hub format, and the two remote-code files.
    `dtype` casts the saved weights. A drafter with a pruned draft vocabulary also needs `target_lm_head` (the
    target, its LM head or the head's (V, H) weight): its rows at the draft ids are written as `lm_head.weight`.
    Returns the output folder."""
    head = official_head(model, target_lm_head)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_dtype = as_dtype(dtype) or model.dtype
    weights = dict(model.state_dict(), **({"lm_head.weight": head} if head is not None else {}))
    state_dict = {
        key: tensor.detach()
        .to(device="cpu", dtype=target_dtype if tensor.is_floating_point() else tensor.dtype)
        .contiguous()
        .clone()
        for key, tensor in weights.items()
    }
    config = official_config_dict(model.config, target_dtype)
    save_file(state_dict, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    for name in REMOTE_CODE_FILES:  # the package's own files: they import only torch / transformers
        shutil.copyfile(Path(configuration_dflash.__file__).with_name(name), out / name)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def take_draft_head(raw: dict, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Drop an official folder's `lm_head.weight` (the target head's rows, which the target lends at run time)
    from `state_dict`, checking that the config marks it as those rows and its shape (N, hidden_size)."""
    size = raw.get("draft_vocab_size")
    if size is None or "lm_head.weight" not in state_dict:
        return  # a head beside the whole vocabulary stays an unexpected key (build_drafter names it)
    head = state_dict.pop("lm_head.weight")
    if raw.get(DRAFT_HEAD_FIELD) != DRAFT_HEAD_TARGET_ROWS:
        raise ValueError(
            f"{source}: the weights hold lm_head.weight but the config has no {DRAFT_HEAD_FIELD}: "
            f'"{DRAFT_HEAD_TARGET_ROWS}": a draft head of its own, while this package drafts with the target '
            "head's rows at the draft ids (save_official writes those, marked so)."
        )
    expected = [size, raw.get("hidden_size")]
    if list(head.shape) != expected:
        raise ValueError(
            f"{source}: lm_head.weight has shape {list(head.shape)}, but the config says "
            f"[draft_vocab_size, hidden_size] = {expected}."
        )


def load_official(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> DFlashDraftModel:
    """Load an official / SpecForge / vLLM / SGLang DFlash checkpoint folder as a `DFlashDraftModel`
    (eval mode). `dtype="auto"` keeps the stored dtype. Any inconsistency raises a ValueError."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{path} is not a checkpoint folder.")
    raw = read_config(folder)
    source = str(folder / CONFIG_NAME)
    if raw.get("model_type") == "dflash":
        raise ValueError(f"{source} is in the Hub-native format (model_type 'dflash'): use load_drafter.")
    kwargs = dflash_kwargs_from_official(raw, source)
    state_dict = load_state_dict(folder)
    take_draft_head(raw, state_dict, source)
    return build_drafter(kwargs, state_dict, str(folder), dtype, device, attn_implementation)


__all__ = [
    "DRAFT_HEAD_FIELD",
    "DRAFT_HEAD_TARGET_ROWS",
    "OFFICIAL_AUTO_MAP",
    "draft_head_rows",
    "official_head",
    "load_official",
    "official_config_dict",
    "save_official",
    "target_head_weight",
]
