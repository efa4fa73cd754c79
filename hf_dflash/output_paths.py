"""Output paths checked before the work: a command that would fail to write, or would overwrite a file
it did not make (or its own input), says so before it loads a model or generates a token."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["check_new_file", "check_output_folder"]


def _blocking_parent(path: Path) -> Path | None:
    """The first existing ancestor of `path` that is not a folder (so nothing can be created under it)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def check_output_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`path` as a Path, when a folder can be written there (it is one, or can be created).

    Raises:
        ValueError: `path` is a file, or lies under one.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder; give a folder path (new, or one to resume).")
    if (parent := _blocking_parent(path)) is not None:
        raise ValueError(f"{flag} {path} cannot be created: {parent} is a file, not a folder.")
    return path


def check_new_file(
    path: str | os.PathLike,
    flag: str = "--out",
    *,
    overwrite: bool = False,
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
) -> Path:
    """`path` as a Path, when an output file may be written there: not a folder, not one of `inputs`
    ({flag: path} of the files the command reads; never, even with `overwrite`), and new unless `overwrite`.

    Raises:
        ValueError: naming the path, the problem and the way out.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'out.jsonl'}.")
    if (parent := _blocking_parent(path)) is not None:
        raise ValueError(f"{flag} {path} cannot be created: {parent} is a file, not a folder.")
    for input_flag, input_path in (inputs or {}).items():
        if input_path is not None and path.exists() and Path(input_path).exists() and path.samefile(input_path):
            raise ValueError(f"{flag} {path} is the input {input_flag} file; write the output to another file.")
    if path.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; choose a new file, or pass --overwrite to replace it.")
    return path
