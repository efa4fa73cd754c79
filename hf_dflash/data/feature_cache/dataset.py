"""Training samples with their cached target features (`OfflineFeatureDataset`), checked against the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from ...packaged_files import file_sha256
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    TEACHER_IDS,
    TEACHER_LOGPROBS,
    read_safetensors_header,
    sample_at,
)

__all__ = ["OfflineFeatureDataset"]


class OfflineFeatureDataset(Dataset):
    """Tokenised samples with their cached target features, read lazily from memory-mapped shards.

    Item: `{"input_ids": (S,) long, "loss_mask": (S,) long, "target_hidden_states": (S, n*Ht)}` (features in
    the cache's dtype), in the order of the tokenised files; a cache with a teacher (`teacher_top_k` K > 0) adds
    `"teacher_ids": (S, K) long` and `"teacher_logprobs": (S, K) float32` (row t: the target's K most likely
    tokens at t + 1). The constructor only reads `index.json` and the
    shards' headers (plus their sha256 with `verify="full"`); shards are opened on first use in each
    process, so DataLoader workers each map their own.

    Raises ValueError (naming the value, shard or sample and the fix) when the cache was made for other
    `target_layer_ids`, hidden size or target, is unfinished, or a shard is truncated or corrupt.
    """

    def __init__(
        self,
        features_dir: str | Path,
        tokenized_dir: str | Path,
        *,
        target_layer_ids: list[int],
        hidden_size: int,
        target_fingerprint: dict | None = None,
        verify: str = "size",
        load_teacher: bool = True,
    ):
        if verify not in ("size", "full"):
            raise ValueError(f"verify={verify!r}; use 'size' (sizes and headers) or 'full' (also sha256).")
        self.features_dir, self.tokenized_dir = Path(features_dir), Path(tokenized_dir)
        index_path = self.features_dir / INDEX_FILE
        if not index_path.is_file():
            raise ValueError(f"No {INDEX_FILE} in {self.features_dir}; create the cache with hf-dflash cache-features.")
        self.index = json.loads(index_path.read_text())
        self._check_index(list(target_layer_ids), hidden_size, target_fingerprint)
        self._check_shards(verify)
        self._check_tokenized_files()
        samples = sorted(self.index["samples"].items(), key=lambda item: (item[1]["file"], item[1]["offset"]))
        self.sample_ids = [sample_id for sample_id, _ in samples]
        self.teacher_top_k = int(self.index.get("teacher_top_k", 0))
        self.load_teacher = load_teacher  # False: items leave a cached teacher out (cross-entropy training)
        self.lengths = [entry["length"] for _, entry in samples]
        self._handles: dict[str, object] = {}
        self._owner_pid = os.getpid()

    def _check_index(self, target_layer_ids: list[int], hidden_size: int, fingerprint: dict | None) -> None:
        index, where = self.index, self.features_dir
        fix = f"re-run hf-dflash cache-features --target-layer-ids {','.join(map(str, target_layer_ids))}"
        if index.get("format") != FORMAT_NAME or index.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{where} has format {index.get('format')!r} v{index.get('format_version')}, expected "
                f"{FORMAT_NAME!r} v{FORMAT_VERSION}; {fix} --out <new folder>."
            )
        if not index.get("complete"):
            raise ValueError(f"The feature cache in {where} is unfinished; {fix} --out {where} to complete it.")
        if index["target_layer_ids"] != target_layer_ids:
            raise ValueError(
                f"{where} was cached with target_layer_ids={index['target_layer_ids']}, the drafter expects "
                f"{target_layer_ids}; {fix} --out <new folder>."
            )
        if index["hidden_size"] != hidden_size:
            raise ValueError(
                f"{where} was cached from a target with hidden_size={index['hidden_size']}, the drafter expects "
                f"target_hidden_size={hidden_size}; {fix} --target <the drafter's target> --out <new folder>."
            )
        if fingerprint is not None:
            cached = index["target"]["fingerprint"]
            for field, value in fingerprint.items():
                if cached.get(field) != value:
                    raise ValueError(
                        f"{where} was cached from another target ({index['target']['name']!r}): {field}="
                        f"{cached.get(field)!r}, this target has {value!r}; {fix} --target <this target> "
                        "--out <new folder>."
                    )

    def _check_shards(self, verify: str) -> None:
        fix = f"delete {self.features_dir} and re-run hf-dflash cache-features --out {self.features_dir}"
        feature_size, dtype = self.index["feature_size"], SAFETENSORS_DTYPES[self.index["dtype"]]
        by_shard: dict[str, list[tuple[str, dict]]] = {}
        for sample_id, entry in self.index["samples"].items():
            by_shard.setdefault(entry["shard"], []).append((sample_id, entry))
        for name, entry in self.index["shards"].items():
            path = self.features_dir / name
            if not path.is_file():
                raise ValueError(f"Feature shard {path} is missing; {fix}.")
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise ValueError(
                    f"Feature shard {path} is {size} bytes, index.json says {entry['bytes']} (truncated or "
                    f"overwritten); {fix}."
                )
            if verify == "full" and (digest := file_sha256(path)) != entry["sha256"]:
                raise ValueError(f"Feature shard {path} has sha256 {digest}, index.json says {entry['sha256']}; {fix}.")
            header = read_safetensors_header(path)
            for sample_id, sample in by_shard.get(name, []):
                for suffix, expected_dtype, width in self._tensors(feature_size, dtype):
                    tensor = header.get(sample["key"] + suffix)
                    expected = [sample["length"], width]
                    if tensor is None or tensor["shape"] != expected or tensor["dtype"] != expected_dtype:
                        found = None if tensor is None else f"{tensor['dtype']} {tensor['shape']}"
                        what = f" ({sample['key'] + suffix!r})" if suffix else ""  # a teacher tensor is named
                        raise ValueError(
                            f"Sample {sample_id!r} in feature shard {path}: expected {expected_dtype} {expected}{what}, "
                            f"found {found}; {fix}."
                        )

    def _tensors(self, feature_size: int, dtype: str) -> list[tuple[str, str, int]]:
        """(name suffix, safetensors dtype, width) of each tensor a sample has in its shard."""
        top_k = int(self.index.get("teacher_top_k", 0))
        teacher = [(TEACHER_IDS, "I32", top_k), (TEACHER_LOGPROBS, "F32", top_k)] if top_k else []
        return [("", dtype, feature_size), *teacher]

    def _check_tokenized_files(self) -> None:
        for recorded in self.index["tokenized_files"]:
            path = self.tokenized_dir / recorded["name"]
            size = path.stat().st_size if path.is_file() else None
            if size != recorded["bytes"]:
                raise ValueError(
                    f"Tokenised file {path} is {size} bytes, the features in {self.features_dir} were cached from "
                    f"{recorded['bytes']} bytes; {self._refresh_fix()}."
                )

    def _refresh_fix(self) -> str:
        return (
            f"the tokenised data changed since caching: delete {self.features_dir} and re-run hf-dflash "
            f"cache-features --data {self.tokenized_dir} --out {self.features_dir}"
        )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _shard(self, name: str):
        if self._owner_pid != os.getpid():  # a forked worker maps its own shards
            self._handles, self._owner_pid = {}, os.getpid()
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.features_dir / name), framework="pt")
        return self._handles[name]

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        sample_id = self.sample_ids[item]
        entry = self.index["samples"][sample_id]
        path = self.tokenized_dir / self.index["tokenized_files"][entry["file"]]["name"]
        sample = sample_at(path, entry["offset"])
        features = self._shard(entry["shard"]).get_tensor(entry["key"])  # (S, n*Ht)
        if sample["id"] != sample_id or len(sample["input_ids"]) != features.shape[0]:
            raise ValueError(
                f"Sample {sample_id!r}: {path} holds {sample['id']!r} with {len(sample['input_ids'])} tokens where "
                f"shard {entry['shard']} has {features.shape[0]} feature rows; {self._refresh_fix()}."
            )
        item = {
            "input_ids": torch.tensor(sample["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.long),
            "target_hidden_states": features,
        }
        if self.teacher_top_k and self.load_teacher:
            shard = self._shard(entry["shard"])
            item["teacher_ids"] = shard.get_tensor(entry["key"] + TEACHER_IDS).long()
            item["teacher_logprobs"] = shard.get_tensor(entry["key"] + TEACHER_LOGPROBS)
        return item

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}
