"""Offline target features: the target's layers computed once over the tokenised data and stored, so
training reads them instead of running the target in every step (`training.feature_mode: offline`).

    format.py   folder layout, index.json, tensor names, reading the files (FORMAT_VERSION)
    writer.py   cache_features: the resumable run of the target (hf-dflash cache-features)
    dataset.py  OfflineFeatureDataset: tokenised samples with their cached features, checked
"""

from .dataset import OfflineFeatureDataset
from .format import FORMAT_VERSION, target_fingerprint
from .writer import cache_features

__all__ = ["FORMAT_VERSION", "OfflineFeatureDataset", "cache_features", "target_fingerprint"]
