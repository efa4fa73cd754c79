from .configuration_dflash import DFlashConfig, choose_mask_token_id, default_target_layer_ids
from .modeling_dflash import DFlashDraftModel, DFlashPreTrainedModel

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashPreTrainedModel",
    "choose_mask_token_id",
    "default_target_layer_ids",
]
