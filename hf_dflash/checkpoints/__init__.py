"""DFlash drafter checkpoints: reading, writing, converting and publishing them (Hub-native, official, speculators).

files.py        file names, config.json, safetensors weights, dtypes, Hub download
building.py     a DFlashDraftModel from translated config kwargs + a state dict
hub.py          Hub-native format ("hub"): save_hub
official.py     official / SpecForge / vLLM / SGLang format ("official"): save_official, load_official
speculators.py  vLLM speculators format ("speculators"): load_speculators, save_speculators
loading.py      detect_format, load_drafter (any format), drafter_from_model, looks_like_dflash_drafter
converting.py   convert (hf-dflash convert)
publish.py      export_drafter (a complete Hub repository folder), push_folder (hf-dflash export / push)
vocabulary.py   expand_draft_vocabulary (a pruned draft vocabulary to the whole one, for the engines)
"""

from .converting import FORMATS, convert
from .files import CONFIG_NAME, CUSTOM_GENERATE_FILE, REMOTE_CODE_FILES, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .hub import HUB_AUTO_MAP, save_hub
from .loading import detect_format, drafter_from_model, load_drafter, looks_like_dflash_drafter
from .official import OFFICIAL_AUTO_MAP, load_official, official_config_dict, save_official
from .publish import OFFICIAL_SUBFOLDER, export_drafter, push_folder
from .speculators import (
    SPECULATORS_VERIFIER_COPIES,
    dflash_kwargs_from_speculators,
    is_speculators_config,
    load_speculators,
    save_speculators,
)
from .vocabulary import expand_draft_vocabulary

__all__ = [
    "CONFIG_NAME",
    "CUSTOM_GENERATE_FILE",
    "FORMATS",
    "HUB_AUTO_MAP",
    "OFFICIAL_AUTO_MAP",
    "OFFICIAL_SUBFOLDER",
    "REMOTE_CODE_FILES",
    "SPECULATORS_VERIFIER_COPIES",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "convert",
    "detect_format",
    "dflash_kwargs_from_speculators",
    "drafter_from_model",
    "expand_draft_vocabulary",
    "export_drafter",
    "is_speculators_config",
    "load_drafter",
    "load_official",
    "load_speculators",
    "looks_like_dflash_drafter",
    "official_config_dict",
    "push_folder",
    "save_hub",
    "save_official",
    "save_speculators",
]
