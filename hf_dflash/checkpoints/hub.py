"""The Hub-native format ("hub"): what `save_pretrained` writes, checked.

`config.json` with `model_type: "dflash"`, every field top-level and an `auto_map` pointing at the
two self-contained remote-code files copied next to it (`configuration_dflash.py`,
`modeling_dflash.py`), `custom_generate/generate.py` (the DFlash loop for plain Transformers'
`generate(custom_generate=dir, trust_remote_code=True)`), `model.safetensors` and a short `README.md`.
Loads and generates with `trust_remote_code=True` without this package.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import torch

from ..hub_cards.card import short_model_card
from ..modeling_dflash import DFlashDraftModel, custom_generate
from .files import CONFIG_NAME, CUSTOM_GENERATE_FILE, REMOTE_CODE_FILES, as_dtype

HUB_AUTO_MAP = {
    "AutoConfig": "configuration_dflash.DFlashConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
}

_HF_DFLASH_IMPORT = re.compile(r"^\s*(from|import)\s+hf_dflash\b", re.MULTILINE)
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.", re.MULTILINE)
CUSTOM_GENERATE_SOURCE = Path(custom_generate.__file__)


def save_hub(
    model: DFlashDraftModel,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    model_card: bool = True,
) -> Path:
    """Write the Hub-native format: `config.json` (`model_type: "dflash"`, all fields top-level,
    `auto_map`), `configuration_dflash.py`, `modeling_dflash.py`, `custom_generate/generate.py`,
    `model.safetensors` and, unless one exists or `model_card=False`, a short `README.md`.

    `dtype` (e.g. `torch.bfloat16`) casts the saved weights; the given model is left unchanged.
    Returns the output folder.
    """
    out = Path(out_dir)
    target_dtype = as_dtype(dtype)
    if target_dtype is not None and target_dtype != model.dtype:
        model = copy.deepcopy(model).to(target_dtype)
    model.save_pretrained(out, safe_serialization=True)

    config = json.loads((out / CONFIG_NAME).read_text(encoding="utf-8"))
    if config.get("model_type") != "dflash" or config.get("auto_map") != HUB_AUTO_MAP:
        raise RuntimeError(
            f"save_pretrained wrote model_type={config.get('model_type')!r}, auto_map={config.get('auto_map')!r}; "
            f"expected 'dflash' and {HUB_AUTO_MAP} (is the model class registered for AutoModel?)."
        )
    generate_file = out / CUSTOM_GENERATE_FILE
    generate_file.parent.mkdir(exist_ok=True)
    generate_file.write_text(CUSTOM_GENERATE_SOURCE.read_text(encoding="utf-8"), encoding="utf-8")
    for name in (*REMOTE_CODE_FILES, CUSTOM_GENERATE_FILE):
        code_file = out / name
        if not code_file.is_file():
            raise RuntimeError(f"save_pretrained did not copy the remote-code file {name} into {out}.")
        check_remote_code(code_file, standalone=name == CUSTOM_GENERATE_FILE)
    if model_card and not (out / "README.md").exists():
        (out / "README.md").write_text(short_model_card(model.config), encoding="utf-8")
    return out


def check_remote_code(code_file: Path, standalone: bool = False) -> None:
    """RuntimeError when remote code imports hf_dflash (users of the Hub repo may not have it) or, for a
    file loaded on its own (`custom_generate/generate.py`), a sibling module by a relative import."""
    text = code_file.read_text(encoding="utf-8")
    if _HF_DFLASH_IMPORT.search(text):
        raise RuntimeError(f"{code_file} imports hf_dflash; remote code must only import torch/transformers.")
    if standalone and _RELATIVE_IMPORT.search(text):
        raise RuntimeError(f"{code_file} has a relative import; it is loaded on its own and must be self-contained.")


__all__ = ["HUB_AUTO_MAP", "check_remote_code", "save_hub"]
