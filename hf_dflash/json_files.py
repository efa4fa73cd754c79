"""Reading JSON files with errors that name the file."""

import json
import os
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
