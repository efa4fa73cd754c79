"""The offline feature cache's format: folder layout, `index.json`, tensor names, reading its files.

Layout of a feature cache folder (`FORMAT_VERSION` 1):

    index.json                   what was cached, by which target, and where (schema below)
    features-00000.safetensors   one tensor per sample, (S, n*Ht) in fp16/bf16/fp32, keyed by `key`
    features-00001.safetensors   ...
    progress.jsonl               only while a run is unfinished: one line per finished shard

`index.json`:

    {"format": "hf_dflash.offline_features", "format_version": 1, "complete": true,
     "target": {"name": str | null,
                "fingerprint": {"model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                                "embedding_sha256"}},
     "target_layer_ids": [int], "hidden_size": Ht, "feature_size": n*Ht, "dtype": "bfloat16",
     "tokenized_files": [{"name": "tokenized-00000.jsonl", "bytes": int}],
     "num_samples": int, "num_tokens": int,
     "shards": {"features-00000.safetensors": {"bytes": int, "sha256": str, "num_samples": int}},
     "samples": {sample_id: {"shard": str, "key": str, "length": S, "file": i, "offset": int}}}

`file`/`offset` locate the sample's line in `tokenized_files[file]`, so reading a sample never scans the
tokenised data. How a run writes and resumes: `writer.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..tokenized import validate_sample

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "PROGRESS_FILE",
    "SAFETENSORS_DTYPES",
    "SHARD_PATTERN",
    "STORAGE_DTYPES",
    "TEACHER_IDS",
    "TEACHER_LOGPROBS",
    "TOKENIZED_GLOB",
    "feature_key",
    "parse_sample",
    "read_safetensors_header",
    "sample_at",
    "target_fingerprint",
]

FORMAT_NAME = "hf_dflash.offline_features"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.jsonl"
SHARD_PATTERN = "features-{:05d}.safetensors"
TOKENIZED_GLOB = "tokenized-*.jsonl"
# With `teacher_top_k` K in the index, each sample also has `<key>.teacher_ids` (S, K) int32 and
# `<key>.teacher_logprobs` (S, K) float32: the target's K most likely next tokens at each position, descending.
TEACHER_IDS = ".teacher_ids"
TEACHER_LOGPROBS = ".teacher_logprobs"
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
EMBEDDING_ROWS_HASHED = 8
_SAFE_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


def target_fingerprint(target: PreTrainedModel) -> dict:
    """What identifies the target that produced a cache: its shape and a hash of its first embedding rows.

    The rows are rounded to bf16 before hashing, so the same checkpoint loaded in fp32, bf16 or fp16
    gives the same fingerprint (the cached features are valid for any of them).
    """
    config = target.config.get_text_config()
    rows = target.get_input_embeddings().weight[:EMBEDDING_ROWS_HASHED].detach()
    rows = rows.to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16)
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "embedding_sha256": hashlib.sha256(rows.numpy().tobytes()).hexdigest(),
    }


def feature_key(sample_id: str) -> str:
    """Tensor name of a sample in its shard: the id itself when it is short and plain, else a safe form.

    Unsafe or long ids become `<sanitised prefix>-<12 hex of sha256(id)>`, so distinct ids never collide.
    """
    if _SAFE_KEY.fullmatch(sample_id) and sample_id != "__metadata__":
        return sample_id
    digest = hashlib.sha256(sample_id.encode()).hexdigest()[:12]
    return f"{_UNSAFE_CHARS.sub('_', sample_id)[:100]}-{digest}"


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (without its tensors); ValueError if it cannot be read.

    Also checks that every tensor's byte range lies inside the file, which catches truncation.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            header = json.loads(handle.read(header_len))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        raise ValueError(f"Feature shard {path} is corrupt: its safetensors header is unreadable ({error}).") from None
    data_bytes = size - 8 - header_len
    for name, entry in header.items():
        if name != "__metadata__" and entry["data_offsets"][1] > data_bytes:
            raise ValueError(
                f"Feature shard {path} is truncated: tensor {name!r} ends at byte {entry['data_offsets'][1]} "
                f"of a {data_bytes}-byte data section."
            )
    return header


def parse_sample(line: bytes, path: Path, offset: int, vocab_size: int | None = None) -> dict:
    """One tokenised sample `{"id", "input_ids", "loss_mask"}`, checked; ValueError naming the line otherwise."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} at byte {offset}: not a JSON line ({error}).") from None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        raise ValueError(f"{path} at byte {offset}: a tokenised sample needs a string 'id', got {str(record)[:80]!r}.")
    sample = {"id": record["id"], **validate_sample(record, f"sample {record['id']!r} in {path}", vocab_size)}
    if not sample["input_ids"]:
        raise ValueError(f"Sample {sample['id']!r} in {path} has no tokens.")
    return sample


def sample_at(path: Path, offset: int) -> dict:
    """The tokenised sample on the line that starts at byte `offset` of `path` (`parse_sample`)."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return parse_sample(handle.readline(), path, offset)
