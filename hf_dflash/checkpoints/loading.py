"""Loading any DFlash drafter: format detection, `load_drafter`, and drafter objects built by other code.

Formats: Hub-native ("hub", `hub.py`), official / SpecForge / vLLM / SGLang ("official",
`official.py`) and vLLM speculators ("speculators", `speculators.py`).

* DFlash2 (z-lab's `DFlash2DraftModel`, docs/dflash2.md): grouped dynamic convolutions around each
  sublayer and a candidate selector. Read and written in the official layout (the same `DFlashDraftModel`
  with its DFlash2 parts); speculators' `dflash2` layout is read and written too.
* A drafter object built by someone else's code (z-lab's `DFlashDraftModel`, a plain `Qwen3Model`
  loaded from an official folder without remote code, ...): `looks_like_dflash_drafter` tells it
  apart from an ordinary assistant model, so `generate` can refuse it instead of running plain
  assisted decoding with a block-diffusion model; `drafter_from_model` translates it into ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..modeling_dflash import DFlashConfig, DFlashDraftModel
from ..modeling_dflash.configuration_dflash import (
    check_checkpoint_fields,
    check_known_keys,
    dflash_kwargs_from_official,
)
from .building import build_drafter, first_problems, shape_mismatch
from .files import CONFIG_NAME, check_weight_files, read_config, resolve_folder, weight_files
from .official import load_official
from .speculators import (
    SPECULATORS_TYPE_FIELD,
    dflash_kwargs_from_speculators,
    is_speculators_config,
    load_speculators,
    without_verifier_copies,
)


def detect_format(path: str | os.PathLike) -> str:
    """'hub', 'official' or 'speculators' (vLLM speculators) for a local checkpoint folder."""
    folder = Path(path)
    config = read_config(folder)
    model_type = config.get("model_type")
    if is_speculators_config(config):
        return "speculators"
    if model_type == "dflash":
        return "hub"
    if model_type == "qwen3":
        if "dflash_config" not in config:
            raise ValueError(
                f"{folder / CONFIG_NAME} has model_type 'qwen3' but no dflash_config: this is a plain Qwen3 "
                "model, not a DFlash drafter."
            )
        return "official"
    raise ValueError(
        f"{folder / CONFIG_NAME} has model_type {model_type!r}; a DFlash drafter has 'dflash' (Hub-native) "
        "or 'qwen3' with a dflash_config (official / SpecForge / vLLM / SGLang), or a speculators_config "
        "(vLLM speculators)."
    )


def check_draft_vocab_shapes(folder: Path, config: dict) -> None:
    """The draft vocabulary buffers of a Hub-format folder have the lengths its config states (d2t:
    draft_vocab_size, t2d: vocab_size); otherwise a ValueError naming the file, the buffer and both
    lengths (Transformers would raise its raw size-mismatch error)."""
    draft_vocab_size = config.get("draft_vocab_size")
    if draft_vocab_size is None:
        return
    expected = {"d2t": ("draft_vocab_size", draft_vocab_size), "t2d": ("vocab_size", config.get("vocab_size"))}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in sorted(set(handle.keys()) & set(expected)):
                shape = list(handle.get_slice(key).get_shape())
                field, size = expected[key]
                if shape != [size]:
                    raise ValueError(
                        f"{file}: {key} has shape {shape}, but {folder / CONFIG_NAME} says {field}={size} "
                        f"(d2t holds one entry per draft id, t2d one per target id); the weights and the config "
                        "come from different drafters."
                    )


def check_weight_shapes(folder: Path) -> None:
    """Every tensor of a Hub-format folder has the shape its config.json describes; otherwise a ValueError
    naming the file, the tensor, its shape there and the config fields behind the expected shape (Transformers
    prints a load report and raises a RuntimeError). Keys are left to `from_pretrained`, which names them."""
    config = DFlashConfig.from_pretrained(str(folder))
    with torch.device("meta"):  # shapes only: nothing is allocated
        expected = {key: tuple(value.shape) for key, value in DFlashDraftModel(config).state_dict().items()}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            mismatched = [
                shape_mismatch(key, shape, expected[key], config, file.name)
                for key in sorted(set(handle.keys()) & set(expected))
                if (shape := tuple(handle.get_slice(key).get_shape())) != expected[key]
            ]
        if mismatched:
            raise ValueError(
                f"{file}: weight shapes do not match {folder / CONFIG_NAME}: {first_problems(mismatched)}. The weights "
                "and the config come from different drafters: set config.json to the sizes the weights were "
                "trained with."
            )


def load_drafter(path: str | os.PathLike, num_target_layers: int | None = None, **kwargs) -> DFlashDraftModel:
    """Load a DFlash drafter from a folder (or Hub repo id): Hub-native, official, or vLLM speculators.

    Hub-native folders go through `DFlashDraftModel.from_pretrained(path, **kwargs)`; official and
    speculators ones through `load_official` / `load_speculators` (which accept `dtype`, `device` (or
    a single-device `device_map`) and `attn_implementation`; speculators checkpoints also need
    `num_target_layers`, the target's depth). Errors are ValueErrors that name the file or value.
    """
    folder = resolve_folder(path, kwargs.get("revision"), kwargs.get("token"))
    kind = detect_format(folder)
    check_weight_files(folder)
    if kind == "hub":
        config = read_config(folder)
        check_known_keys(config, str(folder / CONFIG_NAME))
        check_checkpoint_fields(config, str(folder / CONFIG_NAME))
        check_draft_vocab_shapes(folder, config)
        check_weight_shapes(folder)
        return DFlashDraftModel.from_pretrained(str(folder), **kwargs)
    kwargs.pop("revision", None)
    kwargs.pop("token", None)
    if "device_map" in kwargs:
        device_map = kwargs.pop("device_map")
        if not isinstance(device_map, (str, int, torch.device)) or device_map == "auto":
            raise ValueError(f"Official DFlash checkpoints load onto one device; got device_map={device_map!r}.")
        kwargs.setdefault("device", device_map)
    if kind == "speculators":
        return load_speculators(folder, num_target_layers=num_target_layers, **kwargs)
    return load_official(folder, **kwargs)


def bare_codebook_names(state_dict: dict) -> dict:
    """z-lab's `DFlash2DraftModel` object keeps the selector's codebooks as embeddings
    (`candidate_selector.predecessor_codebook.weight`); files and engines name them bare."""
    codebooks = {f"candidate_selector.{name}_codebook.weight" for name in ("predecessor", "successor")}
    return {key.removesuffix(".weight") if key in codebooks else key: value for key, value in state_dict.items()}


def drafter_from_model(model: torch.nn.Module) -> DFlashDraftModel:
    """Our `DFlashDraftModel` from a DFlash drafter object built by other code (e.g. z-lab's
    `DFlashDraftModel` loaded with `trust_remote_code=True`, or a speculators model): its config is
    translated (official layout, speculators, or ours) and its weights copied, on its device and
    dtype. Raises a ValueError naming what does not fit (missing `fc`, DFlash2, ...)."""
    if isinstance(model, DFlashDraftModel):
        return model
    config = model.config.to_dict()
    source = f"{type(model).__name__} config"
    state_dict = bare_codebook_names({key: value.detach() for key, value in model.state_dict().items()})
    if is_speculators_config(config):
        kwargs = dflash_kwargs_from_speculators(config, source, config.get("num_target_layers"))
        state_dict = without_verifier_copies(state_dict, source, config)
    elif config.get("model_type") == "dflash":
        check_checkpoint_fields(config, source)
        kwargs = {key: config[key] for key in DFlashConfig.__annotations__ if key in config}
    else:
        kwargs = dflash_kwargs_from_official({"model_type": "qwen3", **config}, source)
    parameter = next(model.parameters(), None)
    return build_drafter(
        kwargs,
        state_dict,
        type(model).__name__,
        dtype=parameter.dtype if parameter is not None else "auto",
        device=parameter.device if parameter is not None else None,
    )


def looks_like_dflash_drafter(model) -> bool:
    """Whether `model` (any `nn.Module` given as `assistant_model`) is a DFlash drafter built by other
    code: a DFlash class name, a DFlash config (`dflash_config`, speculators' DFlash, `model_type`
    "dflash"), or the drafter's own weights (`fc.weight` and `hidden_norm.weight` at the top level)."""
    config = getattr(model, "config", None)
    if "dflash" in type(model).__name__.lower():
        return True
    if config is not None and (
        getattr(config, "dflash_config", None) is not None
        or getattr(config, SPECULATORS_TYPE_FIELD, None) is not None
        or getattr(config, "model_type", None) == "dflash"
    ):
        return True
    names = {name for name, _ in model.named_parameters()}
    return {"fc.weight", "hidden_norm.weight"} <= names


__all__ = ["detect_format", "drafter_from_model", "load_drafter", "looks_like_dflash_drafter"]
