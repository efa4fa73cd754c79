"""Compact, versioned training data that can live in the repository: token ids, not text or features.

A packed folder holds `manifest.json` and shards `shard-00000.safetensors`, ... Each shard stores the
samples of some tokenised shards back to back:

    input_ids  (T,)   uint16 (int32 when the vocabulary exceeds 65,536 ids)
    loss_mask  (T,)   uint8, 1 on supervised (assistant) tokens
    offsets    (N+1,) int64, sample i is [offsets[i], offsets[i+1])
    metadata   {"ids": JSON list of the N sample ids}

`manifest.json` records the format, the tokenizer (name, vocabulary size, chat template sha256), every
*part* (one regeneration run: its generation settings and where it came from) and every shard (its part,
the tokenised shards it holds, counts per source, sha256). Packing is incremental and atomic: a new run
appends shards for the tokenised shards not packed yet, writes each shard under a temporary name, and
rewrites the manifest last, so a killed run leaves the previous complete state.

    >>> pack_tokenized("out/tok", "data/smollm2-135m-instruct", part="regen-bf16-1", settings={...}, tokenizer=tok)
    >>> dataset = PackedDataset("data/smollm2-135m-instruct")   # {"id", "input_ids", "loss_mask"} items
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch.utils.data import Dataset

from ..folder_lock import folder_lock
from ..json_files import read_json_object, write_atomic
from ..output_paths import check_output_folder
from ..packaged_files import file_sha256
from .tokenize import chat_template_sha256

__all__ = ["MANIFEST_NAME", "PACKED_FORMAT", "PackedDataset", "is_packed", "pack_tokenized", "read_manifest"]

PACKED_FORMAT = "hf-dflash-packed-v1"
MANIFEST_NAME = "manifest.json"


def source_of(sample_id: str) -> str:
    """The data source of a sample id ("gsm8k:12" -> "gsm8k")."""
    return sample_id.split(":", 1)[0]


def tokenizer_record(tokenizer) -> dict:
    return {
        "name": Path(tokenizer.name_or_path).name,
        "vocab_size": len(tokenizer),
        "chat_template_sha256": chat_template_sha256(tokenizer),
    }


def is_packed(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def read_manifest(folder: str | Path) -> dict:
    """The folder's manifest (ValueError naming the problem when missing, corrupt or of another format)."""
    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: not a packed data folder (see hf_dflash.data.packed).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is corrupt JSON ({error}); restore it (e.g. git checkout).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACKED_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path} is not a {PACKED_FORMAT} manifest (format {found!r}).")
    for key, kind in (("tokenizer", dict), ("parts", dict), ("shards", list)):
        if not isinstance(manifest.get(key), kind):
            raise ValueError(
                f"{path} is corrupt: '{key}' must be a JSON {'object' if kind is dict else 'list'}, got "
                f"{manifest.get(key)!r:.60}; restore it (e.g. git checkout)."
            )
    for index, shard in enumerate(manifest["shards"]):
        missing = [key for key in SHARD_KEYS if not isinstance(shard, dict) or key not in shard]
        if missing:
            raise ValueError(f"{path} is corrupt: shard entry {index} lacks {missing}; restore it (e.g. git checkout).")
    return manifest


SHARD_KEYS = ("file", "part", "tokenized", "samples", "tokens", "supervised_tokens", "per_source", "sha256")
SAMPLE_KEYS = ("id", "input_ids", "loss_mask")


def ids_dtype(vocab_size: int) -> torch.dtype:
    """The storage dtype of token ids: uint16 when every id of the vocabulary fits, else int32."""
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


def sample_problem(sample, vocab_size: int) -> str | None:
    """Why `sample` cannot be packed (None when it can): the field and the value that are wrong.

    A sample is `{"id": non-empty str, "input_ids": [int, ...], "loss_mask": [0|1, ...]}` with ids in
    `[0, vocab_size)` (so within the storage dtype) and one mask value per id.
    """
    if not isinstance(sample, dict):
        return f"expected a JSON object with {', '.join(SAMPLE_KEYS)}, got {type(sample).__name__}"
    missing = [key for key in SAMPLE_KEYS if key not in sample]
    if missing:
        return f"missing field(s) {', '.join(missing)} (a sample holds {', '.join(SAMPLE_KEYS)})"
    if not isinstance(sample["id"], str) or not sample["id"]:
        return f"field id: expected a non-empty string, got {sample['id']!r}"
    ids, mask = sample["input_ids"], sample["loss_mask"]
    for name, values in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(values, list) or not values:
            return f"field {name}: expected a non-empty list of integers, got {values!r:.60}"
        for position, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool):
                return f"field {name}[{position}]: expected an integer, got {value!r}"
    if len(ids) != len(mask):
        return f"field loss_mask has {len(mask)} values for {len(ids)} input_ids: one per token"
    for position, value in enumerate(ids):
        if not 0 <= value < vocab_size:
            return (
                f"field input_ids[{position}] = {value} is outside the tokenizer's vocabulary [0, {vocab_size}) "
                f"(stored as {str(ids_dtype(vocab_size)).removeprefix('torch.')}): tokenised with another tokenizer?"
            )
    for position, value in enumerate(mask):
        if value not in (0, 1):
            return f"field loss_mask[{position}] = {value}: mask values are 0 or 1"
    return None


def encode_shard(samples: list[dict], vocab_size: int) -> bytes:
    """The safetensors bytes of one shard of `{"id", "input_ids", "loss_mask"}` samples (`sample_problem`
    must have found none: an id outside the storage dtype would wrap)."""
    lengths = torch.tensor([len(sample["input_ids"]) for sample in samples], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    input_ids = torch.tensor([t for sample in samples for t in sample["input_ids"]], dtype=torch.int32)
    loss_mask = torch.tensor([m for sample in samples for m in sample["loss_mask"]], dtype=torch.uint8)
    tensors = {"input_ids": input_ids.to(ids_dtype(vocab_size)), "loss_mask": loss_mask, "offsets": offsets}
    return save(tensors, metadata={"ids": json.dumps([sample["id"] for sample in samples])})


def read_tokenized_file(path: Path, vocab_size: int) -> list[dict]:
    """The samples of one `tokenized-*.jsonl` file, each checked (`sample_problem`); a ValueError names the
    file, the line, the sample and the field of the first bad one."""
    samples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error}).") from None
            if (problem := sample_problem(sample, vocab_size)) is not None:
                name = f" sample {sample['id']!r}" if isinstance(sample, dict) and "id" in sample else ""
                raise ValueError(f"{path}:{number}{name}: {problem}. Nothing was packed; fix or re-tokenise it.")
            samples.append(sample)
    return samples


def recorded_settings(tokenized, responses=None, corpus=None, note: str | None = None) -> dict:
    """The settings a packed part records: those of the prepare-data folders that made it (each folder's
    config.json), and a free-text note. ValueError naming the folder when one is not prepare-data's."""
    if not Path(tokenized).is_dir():
        raise ValueError(f"--tokenized {tokenized} is not a folder (give prepare-data's tokenized/ folder).")
    settings = {}
    for key, option, folder in (
        ("regeneration", "responses", responses),
        ("tokenization", "tokenized", tokenized),
        ("corpus", "corpus", corpus),
    ):
        if folder is None:
            continue
        config = Path(folder) / "config.json"
        if not config.is_file():
            raise ValueError(
                f"{config} does not exist: --{option} must be a folder written by hf-dflash prepare-data (it records "
                "its settings in config.json)."
            )
        settings[key] = read_json_object(config, "settings")
    if note:
        settings["note"] = note
    return settings


def check_part_name(part) -> None:
    """A part name is a non-empty string without surrounding spaces (ValueError otherwise)."""
    if not isinstance(part, str) or not part.strip() or part != part.strip():
        raise ValueError(f"part {part!r}: name the regeneration run, e.g. 'regen-bf16-1' (no surrounding spaces).")


def pack_tokenized(
    tokenized_dir: str | Path,
    out_dir: str | Path,
    *,
    part: str,
    settings: dict,
    tokenizer,
    samples_per_shard: int = 2048,
    lock: bool = True,
) -> dict:
    """Append the `tokenized-*.jsonl` shards of `tokenized_dir` not packed yet as part `part`; returns the manifest.

    The folder is locked for the whole call (a second writer is refused: `folder_lock`; `lock=False` when the
    caller holds the lock already, as the CLI does from before it loads the tokenizer); its existing
    shards are checked against their sha256 and every new sample is checked (`sample_problem`) before
    anything is written.

    Args:
        part: name of this regeneration run (e.g. "regen-bf16-1"); its `settings` (generation dtype,
            max_new_tokens, corpus, ...) are recorded once and must not change on later calls.
        samples_per_shard: samples per packed shard (the last one of a call may hold fewer).

    Raises:
        ValueError: another tokenizer than the folder's, changed settings for an existing part, a sample
            id packed already (from another tokenised shard or part), a bad sample, a corrupt existing
            shard, or another process writing to the folder.
    """
    tokenized_dir, out = Path(tokenized_dir), Path(out_dir)
    check_part_name(part)
    if not isinstance(samples_per_shard, int) or isinstance(samples_per_shard, bool) or samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be an integer >= 1, got {samples_per_shard!r}.")
    if not tokenized_dir.is_dir():
        raise ValueError(f"{tokenized_dir} is not a folder of tokenized-*.jsonl files (prepare-data's tokenized/).")
    check_output_folder(out)
    if not lock:
        return _pack_locked(tokenized_dir, out, part, settings, tokenizer, samples_per_shard)
    with folder_lock(out, "pack-data"):
        return _pack_locked(tokenized_dir, out, part, settings, tokenizer, samples_per_shard)


def _pack_locked(tokenized_dir: Path, out: Path, part: str, settings: dict, tokenizer, samples_per_shard: int):
    tok = tokenizer_record(tokenizer)
    if is_packed(out):
        manifest = read_manifest(out)
        if manifest["tokenizer"] != tok:
            raise ValueError(f"{out} was packed with tokenizer {manifest['tokenizer']}, not {tok}; use another folder.")
    else:
        manifest = {"format": PACKED_FORMAT, "tokenizer": tok, "parts": {}, "shards": [], "totals": {}}
    recorded = manifest["parts"].get(part)
    if recorded is not None and recorded["settings"] != json.loads(json.dumps(settings)):
        raise ValueError(
            f"Part {part!r} of {out} was packed with other settings ({recorded['settings']}); name a new part."
        )
    seen = set()
    for shard in manifest["shards"]:  # appending to a corrupt folder would hide the damage under new shards
        seen.update(sample["id"] for sample in PackedDataset.read_shard(out / shard["file"], shard["sha256"]))
    done = {(shard["part"], name) for shard in manifest["shards"] for name in shard["tokenized"]}
    pending = [path for path in sorted(tokenized_dir.glob("tokenized-*.jsonl")) if (part, path.name) not in done]

    files = []  # (name, samples) of every pending file, all checked before the first write
    for path in pending:
        samples = read_tokenized_file(path, tok["vocab_size"])
        for sample in samples:
            if sample["id"] in seen:
                raise ValueError(
                    f"{path}: sample {sample['id']!r} is packed already in {out}; drop it or use another folder."
                )
            seen.add(sample["id"])
        files.append((path.name, samples))

    manifest["parts"].setdefault(part, {"settings": settings})
    batch, names = [], []

    def flush() -> None:
        if not batch:
            return
        index = len(manifest["shards"])
        name = f"shard-{index:05d}.safetensors"
        data = encode_shard(batch, tok["vocab_size"])
        write_atomic(out / name, data)
        per_source = Counter(source_of(sample["id"]) for sample in batch)
        manifest["shards"].append(
            {
                "file": name,
                "part": part,
                "tokenized": list(names),
                "samples": len(batch),
                "tokens": sum(len(s["input_ids"]) for s in batch),
                "supervised_tokens": sum(sum(s["loss_mask"]) for s in batch),
                "per_source": dict(sorted(per_source.items())),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
        manifest["totals"] = totals(manifest["shards"])
        write_atomic(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")  # last: the commit point
        batch.clear()
        names.clear()

    for name, samples in files:
        batch.extend(samples)
        names.append(name)
        if len(batch) >= samples_per_shard:
            flush()
    flush()
    if not is_packed(out):
        write_atomic(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


def totals(shards: list[dict]) -> dict:
    per_source: Counter = Counter()
    for shard in shards:
        per_source.update(shard["per_source"])
    return {
        "samples": sum(s["samples"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "supervised_tokens": sum(s["supervised_tokens"] for s in shards),
        "per_source": dict(sorted(per_source.items())),
    }


class PackedDataset(Dataset):
    """The samples of a packed folder, in shard order: `{"id", "input_ids": list, "loss_mask": list}`.

    Every shard's sha256 is checked against the manifest when the dataset is built (a corrupt or edited
    shard is a ValueError naming it). `parts` keeps only the shards of those parts; `self.parts[i]`
    is the part of sample i.
    """

    def __init__(self, folder: str | Path, vocab_size: int | None = None, parts: list[str] | None = None):
        self.folder = Path(folder)
        manifest = read_manifest(self.folder)
        if vocab_size is not None and manifest["tokenizer"]["vocab_size"] > vocab_size:
            raise ValueError(
                f"{self.folder} holds token ids of a {manifest['tokenizer']['vocab_size']}-token vocabulary; the "
                f"target has {vocab_size} embedding rows: wrong target?"
            )
        unknown = sorted(set(parts or ()) - set(manifest["parts"]))
        if unknown:
            raise ValueError(f"{self.folder} has no part(s) {unknown}; it has {sorted(manifest['parts'])}.")
        self.part_names = sorted(manifest["parts"])
        self.samples: list[dict] = []
        self.parts: list[str] = []  # the part of each sample
        for shard in manifest["shards"]:
            if parts is not None and shard["part"] not in parts:
                continue
            samples = self.read_shard(self.folder / shard["file"], shard["sha256"])
            self.samples.extend(samples)
            self.parts.extend([shard["part"]] * len(samples))

    @staticmethod
    def read_shard(path: Path, sha256: str) -> list[dict]:
        if not path.is_file():
            raise ValueError(f"{path} is listed in the manifest but missing.")
        if file_sha256(path) != sha256:
            raise ValueError(f"{path} does not match its sha256 in the manifest: corrupt or edited; restore it.")
        with safe_open(str(path), framework="pt") as handle:
            ids = json.loads(handle.metadata()["ids"])
            input_ids = handle.get_tensor("input_ids").to(torch.long).tolist()
            loss_mask = handle.get_tensor("loss_mask").tolist()
            offsets = handle.get_tensor("offsets").tolist()
        return [
            {"id": sample_id, "input_ids": input_ids[start:end], "loss_mask": loss_mask[start:end]}
            for sample_id, start, end in zip(ids, offsets[:-1], offsets[1:])
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]
