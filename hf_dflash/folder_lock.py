"""One writer per output folder: a non-blocking lock file inside the folder (stdlib only, POSIX `flock`).

Every command that writes a result into a folder it may share with another run (pack-data, training's
output_dir, cache-features, regeneration and prepare-data folders, export, push, bench --out) holds
`folder_lock(folder)` while it writes: a second process gets a `FolderLockedError` (a ValueError) at once
instead of interleaving its files (docs/reliability.md lists them all).

    with folder_lock(out, "pack-data"):
        ...  # write shards, then the manifest

A command that writes one file (`generate --out FILE`), or replaces a whole folder (`convert --overwrite`),
holds `path_lock(path)` instead: the lock file `.NAME.hf-dflash.lock` lies beside it, in its parent folder.

The lock file (`.hf-dflash.lock`) is removed on release. A holder that was killed leaves the file but
not the lock (the kernel drops `flock` locks with the process), so the next run takes it. A lock taken
on a file that another holder has just removed is detected and taken again on the new file. Creating the
lock file is also the write probe: a folder that cannot be written is named (a ValueError) before the work.
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

__all__ = ["LOCK_NAME", "FolderLockedError", "folder_lock", "lock_path_beside", "path_lock"]

LOCK_NAME = ".hf-dflash.lock"


class FolderLockedError(ValueError):
    """Another process holds the folder's lock."""


def _unwritable(folder: Path, what: str, error: OSError) -> ValueError:
    return ValueError(
        f"{folder} cannot be written ({error.strerror or type(error).__name__}); {what} needs a folder it can "
        "create files in: choose another, or fix its permissions. Nothing was loaded or written."
    )


def _lock_once(path: Path, what: str, folder: Path, kind: str = "folder", wait: bool = False) -> int | None:
    """The descriptor of `path` locked by us (waiting for another holder when `wait`), or None when the file was
    replaced under us (retry)."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise _unwritable(path.parent, what, error) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.read(descriptor, 200).decode("utf-8", "replace").strip()
        os.close(descriptor)
        raise FolderLockedError(
            f"another process is writing to {folder} (lock file {path}{f', held by {holder}' if holder else ''}); "
            f"wait for it to finish or choose another {kind} for {what}."
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


def _make_folder(folder: Path, what: str) -> list[Path]:
    """Create `folder` (and its parents); returns the folders created, innermost first."""
    created = [candidate for candidate in (folder, *folder.parents) if not candidate.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise  # a file in the way: the OSError names it
    except OSError as error:
        raise _unwritable(created[-1].parent if created else folder, what, error) from None
    return created


def _remove_if_empty(created: list[Path]) -> None:
    """Remove the folders a lock created (innermost first) while a refusal or an error left them empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def _hold(
    lock_file: Path, subject: Path, what: str, kind: str, created: list[Path], wait: bool = False
) -> Iterator[None]:
    """Hold `lock_file` for the block (`subject`, `kind` and `what` name it in a refusal; `wait`: wait for
    another holder instead of refusing)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    descriptor = None
    try:
        while descriptor is None:
            descriptor = _lock_once(lock_file, what, subject, kind, wait)
    except BaseException:
        _remove_if_empty(created)
        raise
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_file)  # while still holding it: a waiter that opened this file sees it replaced
        os.close(descriptor)
        if failed:
            _remove_if_empty(created)


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "this output") -> Iterator[Path]:
    """Hold `folder`'s lock (creating the folder) for the duration of the block; yields the folder.
    Folders it created are removed again when the block fails and leaves them empty.

    Raises:
        FolderLockedError: another process holds it (names the folder, the lock file and the way out).
        ValueError: the folder cannot be created or written (names it).
    """
    folder = Path(folder)
    created = _make_folder(folder, what)
    with _hold(folder / LOCK_NAME, folder, what, "folder", created):
        yield folder


def lock_path_beside(path: str | os.PathLike) -> Path:
    """The lock file of `path_lock(path)`: `.NAME.hf-dflash.lock` in `path`'s folder."""
    path = Path(path)
    return path.parent / f".{path.name}{LOCK_NAME}"


@contextlib.contextmanager
def path_lock(
    path: str | os.PathLike, what: str = "this output", kind: str | None = None, wait: bool = False
) -> Iterator[Path]:
    """Hold the lock of one output path (a file, or a folder replaced whole) for the duration of the block:
    the lock file lies beside it (`lock_path_beside`), in its parent folder (created); yields `path`.
    `kind` ("file" or "folder") names what to choose instead in a refusal (default: what `path` is now).
    `wait=True` waits while another process holds it (for work that the second process then need not do).

    Raises:
        FolderLockedError: another process holds it (names the path, the lock file and the way out).
        ValueError: the parent folder cannot be created or written (names it).
    """
    path = Path(path)
    created = _make_folder(path.parent, what)
    kind = kind or ("folder" if path.is_dir() else "file")
    with _hold(lock_path_beside(path), path, what, kind, created, wait):
        yield path
