"""Writing the offline feature cache: run the target once over the tokenised data, store the drafter's layers.

Resumable (format: `format.py`): each shard is written to a temporary name and renamed when complete,
then recorded in `progress.jsonl`; a restart skips the samples of recorded shards and overwrites
anything else. Shards hold whole batches and batches are planned over all samples, so an
interrupted-then-resumed run writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ...folder_lock import folder_lock
from ...json_files import write_json_atomic
from ...packaged_files import file_sha256
from ...target_features import compute_target_features, compute_target_features_and_top_logprobs
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    PROGRESS_FILE,
    SHARD_PATTERN,
    STORAGE_DTYPES,
    TEACHER_IDS,
    TEACHER_LOGPROBS,
    TOKENIZED_GLOB,
    feature_key,
    parse_sample,
    sample_at,
    target_fingerprint,
)

__all__ = ["cache_features"]


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


def plan_batches(samples: list[dict], batch_size: int) -> list[list[dict]]:
    """Samples sorted by length (stable), cut into batches: little padding, and a deterministic plan."""
    ordered = sorted(samples, key=lambda sample: sample["length"])
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]


def read_tokens(tokenized_dir: Path, files: list[dict], batch: list[dict]) -> list[list[int]]:
    """The input_ids of each sample of `batch`, read from their recorded lines."""
    return [sample_at(tokenized_dir / files[sample["file"]]["name"], sample["offset"])["input_ids"] for sample in batch]


def batch_features(
    target: PreTrainedModel,
    tokens: list[list[int]],
    target_layer_ids: list[int],
    dtype: torch.dtype,
    teacher_top_k: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """One padded causal forward over a batch -> per sample, its tensors by name suffix, padding rows dropped:
    "" the (S_i, n*Ht) features; with `teacher_top_k` K also TEACHER_IDS (S_i, K) int32 and TEACHER_LOGPROBS
    (S_i, K) float32, the target's K most likely next tokens at each position."""
    lengths = [len(ids) for ids in tokens]
    device = target.get_input_embeddings().weight.device
    input_ids = torch.zeros((len(tokens), max(lengths)), dtype=torch.long)  # (B, S), right-padded
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(tokens):
        input_ids[row, : len(ids)] = torch.as_tensor(ids)
        attention_mask[row, : len(ids)] = 1
    # Right padding + causal attention: real tokens never see a pad, so each row equals its sample alone.
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    tensors = {}
    if teacher_top_k:
        features, ids, logprobs = compute_target_features_and_top_logprobs(
            target, input_ids, target_layer_ids, attention_mask, teacher_top_k
        )
        tensors[TEACHER_IDS], tensors[TEACHER_LOGPROBS] = ids.to("cpu", torch.int32), logprobs.to("cpu")
    else:
        features = compute_target_features(target, input_ids, target_layer_ids, attention_mask)
    tensors[""] = features.to(device="cpu", dtype=dtype)  # (B, S, n*Ht)
    return [{suffix: t[row, :length].clone() for suffix, t in tensors.items()} for row, length in enumerate(lengths)]


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """Write one shard under a temporary name, rename it into place; return its size, sha256 and tensor count."""
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
    for field in ("format_version", "target_layer_ids", "hidden_size", "dtype", "teacher_top_k"):
        if existing.get(field, 0) != header.get(field, 0):  # teacher_top_k: absent (0) in caches without a teacher
            raise ValueError(
                f"{out_dir} holds features with {field}={existing.get(field, 0)!r}, this run asks for "
                f"{header.get(field, 0)!r}; choose another --out folder or delete {out_dir}."
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
    *,
    teacher_top_k: int = 0,
    lock: bool = True,
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
        teacher_top_k: K > 0 also stores the target's K most likely next tokens and their log-probabilities at
            every position (`<key>.teacher_ids`, `<key>.teacher_logprobs`), the teacher of offline distillation
            (`loss_type` "kl" / "ce+kl"); 0 stores features only.
        lock: hold `folder_lock(out_dir)` for the call; False when the caller holds it already (the CLI takes it
            before it loads the target).

    Returns:
        `out_dir` as a Path; its `index.json` is written last, with `"complete": true`.
    """
    tokenized_dir, out_dir = Path(tokenized_dir), Path(out_dir)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    header = cache_header(target, target_layer_ids, dtype, target_name, teacher_top_k)
    fingerprint = header["target"]["fingerprint"]
    files, samples = scan_tokenized(tokenized_dir, fingerprint["vocab_size"])
    if teacher_top_k:
        check_teacher_names(samples)

    # one writer per cache folder (created)
    with folder_lock(out_dir, "cache-features") if lock else contextlib.nullcontext(out_dir):
        done = start_or_resume(out_dir, header, samples)
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
                computed = batch_features(target, tokens, target_layer_ids, dtype, teacher_top_k)
                for sample, tensors in zip(todo, computed):
                    for suffix, tensor in tensors.items():
                        pending[sample["key"] + suffix] = tensor
                        pending_bytes += tensor.numel() * tensor.element_size()
                    pending_samples[sample["id"]] = {"key": sample["key"], "length": sample["length"]}
                bar.update(len(todo))
                if pending_bytes >= shard_size_bytes:
                    flush_shard(out_dir, done, pending, pending_samples)
                    pending, pending_samples, pending_bytes = {}, {}, 0
            if pending:
                flush_shard(out_dir, done, pending, pending_samples)

        write_json_atomic(out_dir / INDEX_FILE, complete_index(header, files, samples, done))
        (out_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return out_dir


def cache_header(
    target: PreTrainedModel,
    target_layer_ids: list[int],
    dtype: torch.dtype,
    target_name: str | None,
    teacher_top_k: int,
) -> dict:
    """The index header of a cache of these settings (checked: storage dtype, layer ids, teacher count)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in STORAGE_DTYPES:
        raise ValueError(f"dtype={dtype} cannot be stored; use one of {sorted(STORAGE_DTYPES)}.")
    if isinstance(teacher_top_k, bool) or not isinstance(teacher_top_k, int) or teacher_top_k < 0:
        raise ValueError(f"teacher_top_k must be a count >= 0 (0: no teacher), got {teacher_top_k!r}.")
    fingerprint = target_fingerprint(target)
    check_layer_ids(target_layer_ids, fingerprint["num_hidden_layers"])
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "target": {"name": target_name, "fingerprint": fingerprint},
        "target_layer_ids": list(target_layer_ids),
        "hidden_size": fingerprint["hidden_size"],
        "feature_size": len(target_layer_ids) * fingerprint["hidden_size"],
        "dtype": dtype_name,
        **({"teacher_top_k": teacher_top_k} if teacher_top_k else {}),  # absent: features only (older caches too)
    }


def check_teacher_names(samples: list[dict]) -> None:
    """A sample's teacher tensors (`<key>.teacher_ids`, ...) must not share a name with another sample's features."""
    keys = {sample["key"]: sample["id"] for sample in samples}
    for key, sample_id in keys.items():
        for suffix in (TEACHER_IDS, TEACHER_LOGPROBS):
            if key + suffix in keys:
                raise ValueError(
                    f"Sample ids {sample_id!r} and {keys[key + suffix]!r} collide with the teacher's tensor "
                    f"names ({key + suffix!r}); rename one, or cache without --teacher-top-k."
                )


def check_layer_ids(target_layer_ids: list[int], num_layers: int) -> None:
    if (
        not target_layer_ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in target_layer_ids)
        or len(set(target_layer_ids)) != len(target_layer_ids)
    ):
        raise ValueError(
            f"target_layer_ids={target_layer_ids} must be distinct, non-empty 0-based decoder layers of a "
            f"{num_layers}-layer target (0..{num_layers - 1})."
        )


def start_or_resume(out_dir: Path, header: dict, samples: list[dict]) -> dict:
    """What the cache folder already holds ({"shards", "samples"}): an unfinished run of the same cache is resumed,
    a new one starts its index; ValueError when a cached sample's length changed (the data was re-tokenised)."""
    index_path = out_dir / INDEX_FILE
    if index_path.is_file():
        check_same_cache(json.loads(index_path.read_text()), header, out_dir)
        done = recover_progress(out_dir)
    else:
        done = {"shards": {}, "samples": {}}
        write_json_atomic(index_path, {**header, "shards": {}, "samples": {}})
        (out_dir / PROGRESS_FILE).unlink(missing_ok=True)
    for sample in samples:
        cached = done["samples"].get(sample["id"])
        if cached is not None and cached["length"] != sample["length"]:
            raise ValueError(
                f"Sample {sample['id']!r} now has {sample['length']} tokens but was cached with {cached['length']}: "
                f"the tokenised data changed; delete {out_dir} and re-run hf-dflash cache-features."
            )
    return done


def complete_index(header: dict, files, samples: list[dict], done: dict) -> dict:
    """The index of a finished cache: every sample's shard entry and where its tokens are."""
    located = {sample["id"]: sample for sample in samples}
    return {
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


def flush_shard(out_dir: Path, done: dict, tensors: dict[str, torch.Tensor], samples: dict[str, dict]) -> None:
    """Write the pending samples as the next shard and record it in progress.jsonl (and in `done`)."""
    name = SHARD_PATTERN.format(len(done["shards"]))
    entry = {**_write_shard(tensors, out_dir / name), "num_samples": len(samples)}  # a teacher adds 2 tensors each
    records = {sample_id: {"shard": name, **sample} for sample_id, sample in samples.items()}
    with open(out_dir / PROGRESS_FILE, "a") as handle:
        handle.write(json.dumps({"shard": name, "entry": entry, "samples": records}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    done["shards"][name] = entry
    done["samples"].update(records)
