"""Offline target features: run the target once over the tokenised data, store the drafter's layers.

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
tokenised data. A run is resumable: each shard is written to a temporary name and renamed when
complete, then recorded in `progress.jsonl`; a restart skips the samples of recorded shards and
overwrites anything else. Shards hold whole batches and batches are planned over all samples, so an
interrupted-then-resumed run writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..packaged_files import file_sha256
from ..target_features import compute_target_features
from .datasets import validate_sample

__all__ = ["FORMAT_VERSION", "OfflineFeatureDataset", "cache_features", "target_fingerprint"]

FORMAT_NAME = "hf_dflash.offline_features"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.jsonl"
SHARD_PATTERN = "features-{:05d}.safetensors"
TOKENIZED_GLOB = "tokenized-*.jsonl"
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


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON to a temporary sibling, then rename it over `path` (never a half-written file)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    os.replace(temporary, path)


def scan_tokenized(tokenized_dir: Path, vocab_size: int) -> tuple[list[dict], list[dict]]:
    """(files, samples): each `tokenized-*.jsonl` file with its size, and each sample's id, length and line.

    Only metadata is kept; a sample's tokens are re-read from (file, offset) when it is batched.
    """
    paths = sorted(tokenized_dir.glob(TOKENIZED_GLOB))
    if not paths:
        raise ValueError(f"No {TOKENIZED_GLOB} files in {tokenized_dir}; point --data at a tokenised data folder.")
    files, samples, keys = [], [], {}
    for file_index, path in enumerate(paths):
        files.append({"name": path.name, "bytes": path.stat().st_size})
        with open(path, "rb") as handle:
            offset = 0
            for line in handle:
                if line.strip():
                    sample = parse_sample(line, path, offset, vocab_size)
                    key = feature_key(sample["id"])
                    if key in keys:
                        raise ValueError(
                            f"Sample ids {keys[key]!r} and {sample['id']!r} in {tokenized_dir} share the tensor name "
                            f"{key!r}; ids must be unique."
                        )
                    keys[key] = sample["id"]
                    samples.append(
                        {
                            "id": sample["id"],
                            "key": key,
                            "length": len(sample["input_ids"]),
                            "file": file_index,
                            "offset": offset,
                        }
                    )
                offset += len(line)
    return files, samples


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


def plan_batches(samples: list[dict], batch_size: int) -> list[list[dict]]:
    """Samples sorted by length (stable), cut into batches: little padding, and a deterministic plan."""
    ordered = sorted(samples, key=lambda sample: sample["length"])
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]


def read_tokens(tokenized_dir: Path, files: list[dict], batch: list[dict]) -> list[list[int]]:
    """The input_ids of each sample of `batch`, read from their recorded lines."""
    tokens = []
    for sample in batch:
        path = tokenized_dir / files[sample["file"]]["name"]
        with open(path, "rb") as handle:
            handle.seek(sample["offset"])
            tokens.append(parse_sample(handle.readline(), path, sample["offset"])["input_ids"])
    return tokens


def batch_features(
    target: PreTrainedModel, tokens: list[list[int]], target_layer_ids: list[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    """One padded causal forward over a batch -> per-sample (S_i, n*Ht) features, padding rows dropped."""
    lengths = [len(ids) for ids in tokens]
    device = target.get_input_embeddings().weight.device
    input_ids = torch.zeros((len(tokens), max(lengths)), dtype=torch.long)  # (B, S), right-padded
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(tokens):
        input_ids[row, : len(ids)] = torch.as_tensor(ids)
        attention_mask[row, : len(ids)] = 1
    # Right padding + causal attention: real tokens never see a pad, so each row equals its sample alone.
    features = compute_target_features(target, input_ids.to(device), target_layer_ids, attention_mask.to(device))
    features = features.to(device="cpu", dtype=dtype)  # (B, S, n*Ht)
    return [features[row, :length].clone() for row, length in enumerate(lengths)]


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """Write one shard under a temporary name, rename it into place; return its size and sha256."""
    temporary = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, path)
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path), "num_samples": len(tensors)}


def recover_progress(out_dir: Path) -> dict:
    """Shards recorded as finished by an earlier run: from index.json (a finished run) and progress.jsonl.

    A torn last line of progress.jsonl (the run died while appending it) is cut off, so the next record
    starts on a fresh line; its shard is redone.
    """
    shards, samples = {}, {}
    index_path, progress_path = out_dir / INDEX_FILE, out_dir / PROGRESS_FILE
    index = json.loads(index_path.read_text())
    shards.update(index["shards"])
    samples.update(index["samples"])
    if progress_path.is_file():
        valid_bytes = 0
        for line in progress_path.read_bytes().splitlines(keepends=True):
            try:
                record = json.loads(line) if line.endswith(b"\n") else None
            except json.JSONDecodeError:
                record = None
            if record is None:
                break
            valid_bytes += len(line)
            shards[record["shard"]] = record["entry"]
            samples.update(record["samples"])
        os.truncate(progress_path, valid_bytes)
    for name, entry in shards.items():
        path = out_dir / name
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise ValueError(
                f"Finished shard {path} is missing or has the wrong size; delete {out_dir} and re-run "
                "hf-dflash cache-features."
            )
    return {"shards": shards, "samples": samples}


def check_same_cache(existing: dict, header: dict, out_dir: Path) -> None:
    """A resumed run must produce the same kind of features as the run that started the folder."""
    for field in ("format_version", "target_layer_ids", "hidden_size", "dtype"):
        if existing.get(field) != header[field]:
            raise ValueError(
                f"{out_dir} holds features with {field}={existing.get(field)!r}, this run asks for "
                f"{header[field]!r}; choose another --out folder or delete {out_dir}."
            )
    if existing["target"]["fingerprint"] != header["target"]["fingerprint"]:
        raise ValueError(
            f"{out_dir} holds features of another target ({existing['target']}); choose another --out folder "
            f"or delete {out_dir}."
        )


@torch.no_grad()
def cache_features(
    target: PreTrainedModel,
    tokenized_dir: str | Path,
    out_dir: str | Path,
    target_layer_ids: list[int],
    dtype: torch.dtype = torch.bfloat16,
    batch_size: int = 4,
    shard_size_bytes: int = 256 * 2**20,
    target_name: str | None = None,
) -> Path:
    """Run `target` over every tokenised sample and store cat(h[i + 1] for i in target_layer_ids).

    Args:
        target: the causal LM the drafter will serve (eval mode; any dtype/device).
        tokenized_dir: folder of `tokenized-*.jsonl` shards, lines `{"id", "input_ids", "loss_mask"}`.
        out_dir: the feature cache folder (created; an unfinished run in it is resumed).
        target_layer_ids: 0-based target decoder layers, as in the drafter's config.
        dtype: storage dtype of the features: torch.bfloat16, torch.float16 or torch.float32.
        batch_size: samples per target forward (batched by similar length, right-padded).
        shard_size_bytes: a shard is closed once it holds at least this many bytes (whole batches).
        target_name: recorded in the index for humans (e.g. "smollm2-135m-instruct").

    Returns:
        `out_dir` as a Path; its `index.json` is written last, with `"complete": true`.
    """
    tokenized_dir, out_dir = Path(tokenized_dir), Path(out_dir)
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype} cannot be stored; use one of {sorted(STORAGE_DTYPES)}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    fingerprint = target_fingerprint(target)
    num_layers = fingerprint["num_hidden_layers"]
    if not target_layer_ids or not all(0 <= i < num_layers for i in target_layer_ids):
        raise ValueError(
            f"target_layer_ids={target_layer_ids} must be non-empty 0-based decoder layers of a "
            f"{num_layers}-layer target (0..{num_layers - 1})."
        )
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "target": {"name": target_name, "fingerprint": fingerprint},
        "target_layer_ids": list(target_layer_ids),
        "hidden_size": fingerprint["hidden_size"],
        "feature_size": len(target_layer_ids) * fingerprint["hidden_size"],
        "dtype": dtype_name,
    }
    files, samples = scan_tokenized(tokenized_dir, fingerprint["vocab_size"])

    out_dir.mkdir(parents=True, exist_ok=True)
    index_path, progress_path = out_dir / INDEX_FILE, out_dir / PROGRESS_FILE
    if index_path.is_file():
        check_same_cache(json.loads(index_path.read_text()), header, out_dir)
        done = recover_progress(out_dir)
    else:
        done = {"shards": {}, "samples": {}}
        write_json_atomic(index_path, {**header, "shards": {}, "samples": {}})
        progress_path.unlink(missing_ok=True)
    for sample in samples:
        cached = done["samples"].get(sample["id"])
        if cached is not None and cached["length"] != sample["length"]:
            raise ValueError(
                f"Sample {sample['id']!r} now has {sample['length']} tokens but was cached with {cached['length']}: "
                f"the tokenised data changed; delete {out_dir} and re-run hf-dflash cache-features."
            )

    target.eval()
    pending: dict[str, torch.Tensor] = {}
    pending_samples: dict[str, dict] = {}
    pending_bytes = 0
    already = sum(sample["id"] in done["samples"] for sample in samples)
    with tqdm(total=len(samples), initial=already, unit="sample", desc="target features") as bar:
        for batch in plan_batches(samples, batch_size):
            todo = [sample for sample in batch if sample["id"] not in done["samples"]]
            if not todo:
                continue
            tokens = read_tokens(tokenized_dir, files, todo)
            for sample, features in zip(todo, batch_features(target, tokens, target_layer_ids, dtype)):
                pending[sample["key"]] = features
                pending_samples[sample["id"]] = {"key": sample["key"], "length": sample["length"]}
                pending_bytes += features.numel() * features.element_size()
            bar.update(len(todo))
            if pending_bytes >= shard_size_bytes:
                flush_shard(out_dir, done, pending, pending_samples)
                pending, pending_samples, pending_bytes = {}, {}, 0
        if pending:
            flush_shard(out_dir, done, pending, pending_samples)

    located = {sample["id"]: sample for sample in samples}
    index = {
        **header,
        "complete": True,
        "tokenized_files": files,
        "num_samples": len(samples),
        "num_tokens": sum(sample["length"] for sample in samples),
        "shards": dict(sorted(done["shards"].items())),
        "samples": {
            sample_id: {**entry, "file": located[sample_id]["file"], "offset": located[sample_id]["offset"]}
            for sample_id, entry in done["samples"].items()
            if sample_id in located
        },
    }
    write_json_atomic(index_path, index)
    progress_path.unlink(missing_ok=True)
    return out_dir


def flush_shard(out_dir: Path, done: dict, tensors: dict[str, torch.Tensor], samples: dict[str, dict]) -> None:
    """Write the pending samples as the next shard and record it in progress.jsonl (and in `done`)."""
    name = SHARD_PATTERN.format(len(done["shards"]))
    entry = _write_shard(tensors, out_dir / name)
    records = {sample_id: {"shard": name, **sample} for sample_id, sample in samples.items()}
    with open(out_dir / PROGRESS_FILE, "a") as handle:
        handle.write(json.dumps({"shard": name, "entry": entry, "samples": records}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    done["shards"][name] = entry
    done["samples"].update(records)


class OfflineFeatureDataset(Dataset):
    """Tokenised samples with their cached target features, read lazily from memory-mapped shards.

    Item: `{"input_ids": (S,) long, "loss_mask": (S,) long, "target_hidden_states": (S, n*Ht)}` (features in
    the cache's dtype), in the order of the tokenised files. The constructor only reads `index.json` and the
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
                tensor = header.get(sample["key"])
                expected = [sample["length"], feature_size]
                if tensor is None or tensor["shape"] != expected or tensor["dtype"] != dtype:
                    found = None if tensor is None else f"{tensor['dtype']} {tensor['shape']}"
                    raise ValueError(
                        f"Sample {sample_id!r} in feature shard {path}: expected {dtype} {expected}, found {found}; "
                        f"{fix}."
                    )

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
        with open(path, "rb") as handle:
            handle.seek(entry["offset"])
            sample = parse_sample(handle.readline(), path, entry["offset"])
        features = self._shard(entry["shard"]).get_tensor(entry["key"])  # (S, n*Ht)
        if sample["id"] != sample_id or len(sample["input_ids"]) != features.shape[0]:
            raise ValueError(
                f"Sample {sample_id!r}: {path} holds {sample['id']!r} with {len(sample['input_ids'])} tokens where "
                f"shard {entry['shard']} has {features.shape[0]} feature rows; {self._refresh_fix()}."
            )
        return {
            "input_ids": torch.tensor(sample["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.long),
            "target_hidden_states": features,
        }

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}
