"""DFlash block-diffusion speculative decoding for Hugging Face Transformers.

Importing this package registers `model_type="dflash"` with `AutoConfig`/`AutoModel` and routes
`target.generate(..., assistant_model=<DFlashDraftModel>)` to the DFlash loop.
"""

from transformers import AutoConfig, AutoModel

from .checkpoints import drafter_from_model, load_drafter
from .generation import (
    AcceptanceStats,
    AdaptiveBlockSize,
    ConfidentPrefix,
    CostModel,
    DFlashCandidateGenerator,
    DFlashGenerateOutput,
    check_pairing,
)
from .generation.hook import install_generate_hook
from .modeling_dflash import DFlashConfig, DFlashDraftModel

AutoConfig.register("dflash", DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)
# save_pretrained then writes auto_map and copies the two self-contained files (Hub remote code).
DFlashConfig.register_for_auto_class()
DFlashDraftModel.register_for_auto_class("AutoModel")
install_generate_hook()

__version__ = "0.1.0"

__all__ = [
    "AcceptanceStats",
    "AdaptiveBlockSize",
    "ConfidentPrefix",
    "CostModel",
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerateOutput",
    "check_pairing",
    "drafter_from_model",
    "load_drafter",
]
