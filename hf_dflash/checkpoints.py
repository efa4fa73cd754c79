"""Reading and writing DFlash drafter checkpoints in the two formats of SPEC §2.

* Hub-native ("hub"): `config.json` with `model_type: "dflash"`, every field top-level and an
  `auto_map` pointing at the two self-contained remote-code files copied next to it
  (`configuration_dflash.py`, `modeling_dflash.py`), `model.safetensors` and a short `README.md`.
  Loads with `AutoModel.from_pretrained(dir, trust_remote_code=True)` without this package.
* Official / SpecForge / vLLM / SGLang ("official"): `config.json` with `model_type: "qwen3"`,
  `architectures: ["DFlashDraftModel"]`, Qwen3 decoder fields, `block_size`, `num_target_layers` and
  `dflash_config: {mask_token_id, target_layer_ids, block_size}`; the same weight keys. Like z-lab's
  releases it carries `auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}` and the two
  remote-code files, so `AutoModel.from_pretrained(dir, trust_remote_code=True)` gives the drafter
  while `AutoConfig` (and engines reading the config through Transformers) still sees a `Qwen3Config`.
* vLLM speculators ("speculators", load only): see `foreign_formats`.

Both formats store exactly the drafter's state-dict keys (`layers.{i}.*`, `norm.weight`, `fc.weight`,
`hidden_norm.weight`; no `model.` prefix, no embedding, no LM head).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .foreign_formats import SPECULATORS_VERIFIER_COPIES, dflash_kwargs_from_speculators, is_speculators_config
from .json_files import read_json_object
from .modeling_dflash import DFlashConfig, DFlashDraftModel
from .modeling_dflash import configuration_dflash as _configuration
from .modeling_dflash.configuration_dflash import (
    OFFICIAL_DECODER_FIELDS,
    check_checkpoint_fields,
    dflash_kwargs_from_official,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
REMOTE_CODE_FILES = ("configuration_dflash.py", "modeling_dflash.py")
HUB_AUTO_MAP = {
    "AutoConfig": "configuration_dflash.DFlashConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
}
OFFICIAL_AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
FORMATS = ("official", "hub")

_HF_DFLASH_IMPORT = re.compile(r"^\s*(from|import)\s+hf_dflash\b", re.MULTILINE)


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'.")
    return resolved


def _read_config(path: Path) -> dict:
    """config.json of a checkpoint folder as a dict, with errors that name the file."""
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise ValueError(f"{path} has no {CONFIG_NAME}; is it a DFlash drafter checkpoint folder?")
    return read_json_object(config_file, "config")


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file or sharded index)."""
    single, index = path / WEIGHTS_NAME, path / WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {error}") from error
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shard files that do not exist: {missing}")
        return files
    other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {other}: re-save as safetensors)" if other else ""
    raise ValueError(f"{path} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}{hint}.")


def _check_weight_files(path: Path) -> list[Path]:
    """Open every shard's header so a corrupt or truncated file is named before loading."""
    files = _weight_files(path)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own SafetensorError / OSError
            raise ValueError(f"{file} is not a readable safetensors file: {error}") from error
    return files


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for file in _check_weight_files(path):
        try:
            shard = load_file(str(file))
        except Exception as error:
            raise ValueError(f"{file} is not a readable safetensors file: {error}") from error
        duplicated = sorted(set(shard) & set(state_dict))
        if duplicated:
            raise ValueError(f"{file} repeats weights already loaded from another shard: {duplicated}")
        state_dict.update(shard)
    return state_dict


def _resolve_folder(path: str | os.PathLike, revision: str | None = None, token=None) -> Path:
    """A local checkpoint folder; a Hub repo id is downloaded (config, weights, code, card)."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint folder that holds {CONFIG_NAME}.")
    try:
        from huggingface_hub import snapshot_download

        downloaded = snapshot_download(
            repo_id=str(path),
            revision=revision,
            token=token,
            allow_patterns=["*.json", "*.safetensors", "*.py", "*.md"],
        )
    except Exception as error:
        raise ValueError(f"{path} is neither a local folder nor a downloadable Hub repository: {error}") from error
    return Path(downloaded)


# --------------------------------------------------------------------------------------------------
# Hub-native format
# --------------------------------------------------------------------------------------------------


def _model_card(config: DFlashConfig) -> str:
    return f"""---
library_name: transformers
tags:
- dflash
- speculative-decoding
- block-diffusion
---

# DFlash drafter

A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for speculative decoding. It has
no embedding and no LM head: it borrows the target model's.

| field | value |
|---|---|
| block_size | {config.block_size} |
| target_layer_ids | {list(config.target_layer_ids)} |
| num_target_layers | {config.num_target_layers} |
| mask_token_id | {config.mask_token_id} |
| vocab_size | {config.vocab_size} |

```python
from transformers import AutoModel

drafter = AutoModel.from_pretrained("<this repo>", trust_remote_code=True)
```
"""


def save_hub(
    model: DFlashDraftModel,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    model_card: bool = True,
) -> Path:
    """Write the Hub-native format: `config.json` (`model_type: "dflash"`, all fields top-level,
    `auto_map`), `configuration_dflash.py`, `modeling_dflash.py`, `model.safetensors` and, unless
    one exists or `model_card=False`, a short `README.md`.

    `dtype` (e.g. `torch.bfloat16`) casts the saved weights; the given model is left unchanged.
    Returns the output folder.
    """
    out = Path(out_dir)
    target_dtype = _as_dtype(dtype)
    if target_dtype is not None and target_dtype != model.dtype:
        model = copy.deepcopy(model).to(target_dtype)
    model.save_pretrained(out, safe_serialization=True)

    config = json.loads((out / CONFIG_NAME).read_text(encoding="utf-8"))
    if config.get("model_type") != "dflash" or config.get("auto_map") != HUB_AUTO_MAP:
        raise RuntimeError(
            f"save_pretrained wrote model_type={config.get('model_type')!r}, auto_map={config.get('auto_map')!r}; "
            f"expected 'dflash' and {HUB_AUTO_MAP} (is the model class registered for AutoModel?)."
        )
    for name in REMOTE_CODE_FILES:
        code_file = out / name
        if not code_file.is_file():
            raise RuntimeError(f"save_pretrained did not copy the remote-code file {name} into {out}.")
        if _HF_DFLASH_IMPORT.search(code_file.read_text(encoding="utf-8")):
            raise RuntimeError(f"{code_file} imports hf_dflash; remote code must only import torch/transformers.")
    if model_card and not (out / "README.md").exists():
        (out / "README.md").write_text(_model_card(model.config), encoding="utf-8")
    return out


# --------------------------------------------------------------------------------------------------
# Official / SpecForge / vLLM / SGLang format
# --------------------------------------------------------------------------------------------------


def official_config_dict(config: DFlashConfig, dtype: torch.dtype) -> dict:
    """The official-format config.json contents for a DFlashConfig whose weights are `dtype`."""
    rope = dict(config.rope_parameters)
    rope_theta = rope.get("rope_theta", 10_000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    # Older engines read rope_theta + rope_scaling (None for plain RoPE).
    rope_scaling = None if scaling in ({}, {"rope_type": "default"}) else scaling
    out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "auto_map": dict(OFFICIAL_AUTO_MAP)}
    out.update({field: getattr(config, field) for field in OFFICIAL_DECODER_FIELDS})
    dflash = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
    }
    if "sliding_attention" in config.layer_types:  # say which semantics the sliding layers were trained with
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
            "dtype": _dtype_name(dtype),
            "torch_dtype": _dtype_name(dtype),
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
    `architectures: ["DFlashDraftModel"]`, `dflash_config`, `auto_map` for AutoModel only),
    `model.safetensors` with the same weight keys as the Hub format, and the two remote-code files.
    `dtype` casts the saved weights. Returns the output folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_dtype = _as_dtype(dtype) or model.dtype
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
        shutil.copyfile(Path(_configuration.__file__).with_name(name), out / name)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def _check_state_dict(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str) -> None:
    """Exact key and shape match against the drafter the config describes."""
    loaded, wanted = set(state_dict), set(expected)
    if loaded != wanted and any(key.startswith("model.") for key in loaded):
        stripped = {key.removeprefix("model.") for key in loaded}
        fix = (
            "strip the prefix: {k.removeprefix('model.'): v for k, v in state_dict.items()}, then re-save"
            if stripped == wanted
            else "strip the prefix and drop keys that are not drafter weights"
        )
        example = next(key for key in sorted(loaded) if key.startswith("model."))
        raise ValueError(
            f"{source}: weight keys carry a 'model.' prefix (e.g. {example!r}); DFlash keys have none "
            f"(layers.{{i}}.*, norm.weight, fc.weight, hidden_norm.weight): {fix}."
        )
    unexpected, missing = sorted(loaded - wanted), sorted(wanted - loaded)
    if unexpected or missing:
        raise ValueError(
            f"{source}: weights do not match the DFlash drafter described by config.json: "
            f"unexpected keys {unexpected}, missing keys {missing}."
        )
    mismatched = [
        f"{key}: checkpoint {tuple(state_dict[key].shape)} vs config {tuple(expected[key].shape)}"
        for key in sorted(wanted)
        if tuple(state_dict[key].shape) != tuple(expected[key].shape)
    ]
    if mismatched:
        raise ValueError(f"{source}: weight shapes do not match config.json: {'; '.join(mismatched)}.")


def _build_drafter(
    kwargs: dict,
    state_dict: dict[str, torch.Tensor],
    source: str,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> DFlashDraftModel:
    """A `DFlashDraftModel` (eval mode) from `DFlashConfig` kwargs and an exactly matching state dict.
    `dtype="auto"` keeps the stored dtype; `source` names the checkpoint in errors."""
    kwargs = dict(kwargs)
    if "target_hidden_size" not in kwargs and isinstance(state_dict.get("fc.weight"), torch.Tensor):
        in_features, num_features = state_dict["fc.weight"].shape[-1], len(kwargs["target_layer_ids"])
        if in_features % num_features == 0:  # older configs omit it; fc's input width tells
            kwargs["target_hidden_size"] = in_features // num_features
    try:
        config = DFlashConfig(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from error

    if dtype == "auto" or dtype is None:
        floating = [t.dtype for t in state_dict.values() if t.is_floating_point()]
        resolved = floating[0] if floating else torch.float32
    else:
        resolved = _as_dtype(dtype)
    from_config_kwargs = {"dtype": resolved}
    if attn_implementation is not None:
        from_config_kwargs["attn_implementation"] = attn_implementation
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older Transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = DFlashDraftModel._from_config(config, **from_config_kwargs)
    _check_state_dict(state_dict, model.state_dict(), source)
    model.load_state_dict(state_dict, strict=True)
    try:
        model.check_draft_vocab()
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    if device is not None:
        model = model.to(device)
    return model.eval()


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
    raw = _read_config(folder)
    source = str(folder / CONFIG_NAME)
    if raw.get("model_type") == "dflash":
        raise ValueError(f"{source} is in the Hub-native format (model_type 'dflash'): use load_drafter.")
    kwargs = dflash_kwargs_from_official(raw, source)
    return _build_drafter(kwargs, _load_state_dict(folder), str(folder), dtype, device, attn_implementation)


def _without_verifier_copies(state_dict: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
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
    """Load a vLLM speculators DFlash checkpoint folder (`speculators_model_type: "dflash"`) as a
    `DFlashDraftModel`. `num_target_layers` is the target's `config.num_hidden_layers` (speculators
    does not record it). What cannot be served raises a ValueError naming it (`foreign_formats`)."""
    folder = Path(path)
    source = str(folder / CONFIG_NAME)
    kwargs = dflash_kwargs_from_speculators(_read_config(folder), source, num_target_layers)
    state_dict = _without_verifier_copies(_load_state_dict(folder), source)
    return _build_drafter(kwargs, state_dict, str(folder), dtype, device, attn_implementation)


def drafter_from_model(model: torch.nn.Module) -> DFlashDraftModel:
    """Our `DFlashDraftModel` from a DFlash drafter object built by other code (e.g. z-lab's
    `DFlashDraftModel` loaded with `trust_remote_code=True`, or a speculators model): its config is
    translated (official layout, speculators, or ours) and its weights copied, on its device and
    dtype. Raises a ValueError naming what does not fit (missing `fc`, DFlash2, ...)."""
    if isinstance(model, DFlashDraftModel):
        return model
    config = model.config.to_dict()
    source = f"{type(model).__name__} config"
    state_dict = {key: value.detach() for key, value in model.state_dict().items()}
    if is_speculators_config(config):
        kwargs = dflash_kwargs_from_speculators(config, source, config.get("num_target_layers"))
        state_dict = _without_verifier_copies(state_dict, source)
    elif config.get("model_type") == "dflash":
        check_checkpoint_fields(config, source)
        kwargs = {key: config[key] for key in DFlashConfig.__annotations__ if key in config}
    else:
        kwargs = dflash_kwargs_from_official({"model_type": "qwen3", **config}, source)
    parameter = next(model.parameters(), None)
    return _build_drafter(
        kwargs,
        state_dict,
        type(model).__name__,
        dtype=parameter.dtype if parameter is not None else "auto",
        device=parameter.device if parameter is not None else None,
    )


# --------------------------------------------------------------------------------------------------
# Format detection and conversion
# --------------------------------------------------------------------------------------------------


def detect_format(path: str | os.PathLike) -> str:
    """'hub', 'official' or 'speculators' (vLLM speculators, load-only) for a local checkpoint folder."""
    folder = Path(path)
    config = _read_config(folder)
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


def load_drafter(path: str | os.PathLike, num_target_layers: int | None = None, **kwargs) -> DFlashDraftModel:
    """Load a DFlash drafter from a folder (or Hub repo id): Hub-native, official, or vLLM speculators.

    Hub-native folders go through `DFlashDraftModel.from_pretrained(path, **kwargs)`; official and
    speculators ones through `load_official` / `load_speculators` (which accept `dtype`, `device` (or
    a single-device `device_map`) and `attn_implementation`; speculators checkpoints also need
    `num_target_layers`, the target's depth). Errors are ValueErrors that name the file or value.
    """
    folder = _resolve_folder(path, kwargs.get("revision"), kwargs.get("token"))
    kind = detect_format(folder)
    _check_weight_files(folder)
    if kind == "hub":
        check_checkpoint_fields(_read_config(folder), str(folder / CONFIG_NAME))
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


def _check_destination(src: str | os.PathLike, dst: Path, overwrite: bool) -> None:
    """Refuse to write over another checkpoint (its stale files would stay beside ours) unless
    `overwrite`, and never replace a folder that holds the source."""
    source = Path(src).resolve() if Path(src).exists() else None
    if source is not None and dst.exists() and (source == dst.resolve() or dst.resolve() in source.parents):
        raise ValueError(f"The destination {dst} is or holds the source {src}; write the conversion elsewhere.")
    if dst.is_file():
        raise ValueError(f"The destination {dst} is a file; give a new or empty folder.")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        held = sorted(p.name for p in dst.iterdir())
        raise ValueError(
            f"The destination {dst} is not empty (it holds {held[:6]}{' ...' if len(held) > 6 else ''}); give a new or "
            "empty folder, or pass --overwrite (overwrite=True) to replace the whole folder."
        )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    num_target_layers: int | None = None,
) -> Path:
    """Convert a drafter checkpoint (any loadable format) to `to` = "official" or "hub" in `dst`.

    `dst` must be new or empty unless `overwrite`, which replaces the whole folder (the conversion is
    written beside it first, so a failure leaves the old folder as it was). `dtype` casts the written
    weights (default: keep). `num_target_layers`: the target's depth, for speculators sources. Returns `dst`.
    """
    if to not in FORMATS:
        raise ValueError(f"to={to!r} is not a checkpoint format; use one of {FORMATS}.")
    destination = Path(dst)
    _check_destination(src, destination, overwrite)
    model = load_drafter(src, num_target_layers=num_target_layers)
    save = save_official if to == "official" else save_hub
    if not (destination.is_dir() and any(destination.iterdir())):
        return save(model, destination, dtype=dtype)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        save(model, staging / "new", dtype=dtype)
        os.replace(destination, staging / "old")
        os.replace(staging / "new", destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return destination


__all__ = [
    "FORMATS",
    "HUB_AUTO_MAP",
    "OFFICIAL_AUTO_MAP",
    "convert",
    "detect_format",
    "drafter_from_model",
    "load_drafter",
    "load_official",
    "load_speculators",
    "official_config_dict",
    "save_hub",
    "save_official",
]
