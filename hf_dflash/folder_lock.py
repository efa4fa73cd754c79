"""One writer per output folder: a non-blocking lock file inside the folder (stdlib only, POSIX `flock`).

Every command that writes into a folder it may share with another run (pack-data, training's output_dir,
cache-features, regeneration and prepare-data folders) holds `folder_lock(folder)` while it writes:
a second process gets a `FolderLockedError` (a ValueError) at once instead of interleaving its files.

    with folder_lock(out, "pack-data"):
        ...  # write shards, then the manifest

The lock file (`.hf-dflash.lock`) is removed on release. A holder that was killed leaves the file but
not the lock (the kernel drops `flock` locks with the process), so the next run takes it. A lock taken
on a file that another holder has just removed is detected and taken again on the new file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; writers are not serialised there
    fcntl = None

__all__ = ["LOCK_NAME", "FolderLockedError", "folder_lock"]

LOCK_NAME = ".hf-dflash.lock"


class FolderLockedError(ValueError):
    """Another process holds the folder's lock."""


def _lock_once(path: Path, what: str, folder: Path) -> int | None:
    """The descriptor of `path` locked by us, or None when the file was replaced under us (retry)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.read(descriptor, 200).decode("utf-8", "replace").strip()
        os.close(descriptor)
        raise FolderLockedError(
            f"another process is writing to {folder} (lock file {path}{f', held by {holder}' if holder else ''}); "
            f"wait for it to finish or choose another folder for {what}."
        ) from None
    try:
        same = os.fstat(descriptor).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the previous holder removed the file between our open and our lock
        os.close(descriptor)
        return None
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"pid {os.getpid()}".encode())
    return descriptor


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "this output") -> Iterator[Path]:
    """Hold `folder`'s lock (creating the folder) for the duration of the block; yields the folder.

    Raises:
        FolderLockedError: another process holds it (names the folder, the lock file and the way out).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield folder
        return
    path = folder / LOCK_NAME
    descriptor = None
    while descriptor is None:
        descriptor = _lock_once(path, what, folder)
    try:
        yield folder
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it: a waiter that opened this file sees it replaced
        os.close(descriptor)
