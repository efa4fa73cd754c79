"""Crash-safe files for the data pipeline: shard names, atomic JSONL writes, stage settings.

A file appears under its final name only once complete (written to a hidden temporary sibling,
then renamed), so after a kill every visible shard is whole. Each stage folder records the settings
it was produced with (`config.json`); resuming with other settings is refused rather than mixing
two kinds of data in one folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..json_files import is_atomic_temporary, write_atomic

__all__ = ["check_stage_config", "shard_name", "write_jsonl_atomic"]

CONFIG_FILE = "config.json"


def shard_name(prefix: str, index: int) -> str:
    """`responses-00003.jsonl` for ("responses", 3)."""
    return f"{prefix}-{index:05d}.jsonl"


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    """Write one JSON object per line, atomically."""
    write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def remove_partial_files(folder: Path) -> None:
    """Delete temporary files a killed run left behind in `folder`."""
    for path in folder.iterdir():
        if is_atomic_temporary(path.name):
            path.unlink()


def check_stage_config(folder: Path, config: dict) -> None:
    """Record `config` in `folder/config.json`, or check it equals the one recorded by an earlier run;
    either way, delete the temporary files a killed run left in `folder`.

    Raises:
        ValueError: `folder` holds output made with other settings (names the differing keys).
    """
    path = folder / CONFIG_FILE
    config = json.loads(json.dumps(config))  # compare as stored (tuples become lists)
    if path.is_file():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(key for key in recorded.keys() | config.keys() if recorded.get(key) != config.get(key))
        if changed:
            details = ", ".join(f"{key}: {recorded.get(key)!r} -> {config.get(key)!r}" for key in changed)
            raise ValueError(
                f"{folder} was prepared with other settings ({details}); resume with the same settings, "
                "or use a new output folder (or delete this one)."
            )
    else:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    remove_partial_files(folder)
