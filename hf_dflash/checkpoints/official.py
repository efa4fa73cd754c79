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
        # the weights. Engines whose DFlash path ignores them draft over the whole vocabulary (lossless).
        out["draft_vocab_size"] = config.draft_vocab_size
    return out


def save_official(
    model: DFlashDraftModel,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
) -> Path:
    """Write the official / SpecForge / vLLM / SGLang format: `config.json` (`model_type: "qwen3"`,
    `architectures: ["DFlashDraftModel"]` or `["DFlash2DraftModel"]`, `dflash_config`, `auto_map` for AutoModel only),
    `model.safetensors` with the same weight keys as the Hub format, and the two remote-code files.
    `dtype` casts the saved weights. Returns the output folder."""
    if model.config.is_dflash2 and model.config.draft_vocab_size is not None:
        raise ValueError(
            f"A DFlash2 drafter with draft_vocab_size={model.config.draft_vocab_size} has no official layout: "
            "DFlash2 readers (vLLM, speculators) rank the whole vocabulary. Save it Hub-native (save_hub / "
            "hf-dflash export), or train it with draft_vocab_size None."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_dtype = as_dtype(dtype) or model.dtype
    state_dict = {
        key: tensor.detach()
        .to(device="cpu", dtype=target_dtype if tensor.is_floating_point() else tensor.dtype)
        .contiguous()
        .clone()
        for key, tensor in model.state_dict().items()
    }
    config = official_config_dict(model.config, target_dtype)
    save_file(state_dict, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    for name in REMOTE_CODE_FILES:  # the package's own files: they import only torch / transformers
        shutil.copyfile(Path(configuration_dflash.__file__).with_name(name), out / name)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


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
    return build_drafter(kwargs, load_state_dict(folder), str(folder), dtype, device, attn_implementation)


__all__ = ["OFFICIAL_AUTO_MAP", "load_official", "official_config_dict", "save_official"]
