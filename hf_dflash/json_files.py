"""Reading JSON files with errors that name the file; writing them atomically."""

import json
import os
import tempfile
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


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Write `payload` as JSON so that `path` is either its old self or complete, never half-written:
    a temporary sibling (unique, so concurrent writers do not collide) renamed over `path`."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(payload, stream, indent=1)
        os.replace(temporary, file)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
