from ..data.feature_cache import OfflineFeatureDataset, cache_features, target_fingerprint
from ..data.tokenized import TokenizedDataset
from ..target_features import compute_target_features
from .arguments import DFlashTrainingArguments
from .collator import DFlashDataCollator
from .forward import dflash_training_forward
from .maths import (
    acceptance_estimate,
    build_blocks,
    build_training_mask,
    decay_weights,
    default_decay_gamma,
    reply_offsets,
    select_anchors,
    weighted_cross_entropy_sum,
)
from .trainer import DFlashTrainer

__all__ = [
    "DFlashDataCollator",
    "DFlashTrainer",
    "DFlashTrainingArguments",
    "OfflineFeatureDataset",
    "TokenizedDataset",
    "acceptance_estimate",
    "build_blocks",
    "build_training_mask",
    "cache_features",
    "compute_target_features",
    "decay_weights",
    "default_decay_gamma",
    "dflash_training_forward",
    "reply_offsets",
    "select_anchors",
    "target_fingerprint",
    "weighted_cross_entropy_sum",
]
