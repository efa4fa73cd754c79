"""Reading JSON and JSONL files (JSON objects with errors that name the file); writing them atomically."""

import gzip
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def read_json_object(path: str | os.PathLike, what: str) -> dict:
    """The JSON object stored in `path` (`what` names it in errors: missing, corrupt, not an object)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{what} file {file} does not exist.")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}.")
    return data


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Rows of a JSONL file, gzipped when its name ends in `.gz`; blank lines skipped."""
    opener = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def is_atomic_temporary(name: str, of: str | None = None) -> bool:
    """Whether a file `name` is a temporary sibling of `write_atomic` (of the file named `of`, or of any file):
    one being written now, or one a killed writer left behind."""
    return name.startswith(f".{of}." if of is not None else ".") and name.endswith(".tmp")


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write `text` (str, or bytes written as they are) to `path` so that `path` is either absent/old or complete, never partial: a unique
    hidden temporary sibling (concurrent writers do not collide), synced, then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        binary = isinstance(text, bytes)
        with os.fdopen(handle, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Write `payload` as JSON atomically (`write_atomic`)."""
    write_atomic(path, json.dumps(payload, indent=1))
