"""Reading a drafter checkpoint folder: file names, `config.json`, safetensors weights, dtypes, Hub download.

Every format stores exactly the drafter's state-dict keys (`layers.{i}.*`, `norm.weight`, `fc.weight`,
`hidden_norm.weight`; no `model.` prefix, no embedding, no LM head) in `model.safetensors` or in
shards listed by `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..json_files import read_json_object

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
REMOTE_CODE_FILES = ("configuration_dflash.py", "modeling_dflash.py")
# `generate(custom_generate=<drafter repo>, trust_remote_code=True)` runs this file (a copy of
# hf_dflash/modeling_dflash/custom_generate.py): DFlash decoding with plain Transformers.
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch.dtype from a dtype or its name ("bfloat16", "torch.float16"); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'.")
    return resolved


def read_config(path: Path) -> dict:
    """config.json of a checkpoint folder as a dict, with errors that name the file."""
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise ValueError(f"{path} has no {CONFIG_NAME}; is it a DFlash drafter checkpoint folder?")
    return read_json_object(config_file, "config")


def weight_files(path: Path) -> list[Path]:
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


def check_weight_files(path: Path) -> list[Path]:
    """Open every shard's header so a corrupt or truncated file is named before loading."""
    files = weight_files(path)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own SafetensorError / OSError
            raise ValueError(
                f"{file} is not a readable safetensors file, a truncated or corrupt weights file ({error}); "
                "copy or download it again."
            ) from error
    return files


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All weights of a checkpoint folder (every shard), refusing a key stored twice."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in check_weight_files(path):
        try:
            shard = load_file(str(file))
        except Exception as error:
            raise ValueError(f"{file} is not a readable safetensors file: {error}") from error
        duplicated = sorted(set(shard) & set(state_dict))
        if duplicated:
            raise ValueError(f"{file} repeats weights already loaded from another shard: {duplicated}")
        state_dict.update(shard)
    return state_dict


def resolve_folder(path: str | os.PathLike, revision: str | None = None, token=None) -> Path:
    """A local checkpoint folder; a Hub repo id is downloaded (config, weights, code, card)."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint folder that holds {CONFIG_NAME}.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        downloaded = snapshot_download(
            repo_id=str(path),
            revision=revision,
            token=token,
            allow_patterns=["*.json", "*.safetensors", "*.py", "*.md"],
        )
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as error:
        raise ValueError(
            f"{path} is neither a local folder nor a Hub repository ({type(error).__name__}): pass a checkpoint "
            "folder, or a Hub repo id you can read (with its revision)."
        ) from error
    except (HfHubHTTPError, OSError) as error:  # no network, offline mode, a refused token, a full disk
        raise OSError(
            f"Could not download the Hub repository {path} ({type(error).__name__}: {error}): check the network "
            "and your token (HF_TOKEN), or pass a local folder."
        ) from error
    return Path(downloaded)


__all__ = [
    "CONFIG_NAME",
    "CUSTOM_GENERATE_FILE",
    "REMOTE_CODE_FILES",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "as_dtype",
    "check_weight_files",
    "dtype_name",
    "load_state_dict",
    "read_config",
    "resolve_folder",
    "weight_files",
]
