"""The one error path of the `hf-dflash` commands and the repository's scripts: a user error becomes
`<prog>: error: <message>` on stderr and exit status 2 (argparse's own status for bad arguments);
a programming error keeps its traceback.

User errors are what bad input, files and folders raise: ValueError and UserTypeError (our named refusals,
corrupt JSON, undecodable text), OSError (a missing, unreadable or misplaced file or folder: the message names it),
safetensors' SafetensorError (a truncated or corrupt weights file) and pickle's UnpicklingError (a
checkpoint file torch refuses to load).

    def main(argv=None) -> int:
        args = parser.parse_args(argv)
        return run_reporting_errors("offline_subset.py", lambda: work(args))
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable

__all__ = ["USAGE_ERROR", "UserTypeError", "describe_user_error", "is_user_error", "run_reporting_errors"]

USAGE_ERROR = 2


class UserTypeError(TypeError):
    """A value of the wrong type that the user gave (a drafter of another class, an id that is an object): a user
    error, where other TypeErrors are programming errors and keep their traceback."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ValueError, UserTypeError, OSError, pickle.UnpicklingError]
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        pass
    else:
        types.append(SafetensorError)
    return tuple(types)


def is_user_error(error: BaseException) -> bool:
    return isinstance(error, _user_error_types())


def describe_user_error(error: BaseException) -> str:
    """The message to print: OSErrors say what the system refused and on which path(s); the others are
    our own named messages (or the library's) as they are, prefixed by their type when it is not ours."""
    if isinstance(error, OSError) and error.filename is not None:
        paths = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 is not None else "")
        reason = error.strerror or type(error).__name__
        return f"{paths}: {reason} ({type(error).__name__}); check the path, or choose another one."
    if isinstance(error, (ValueError, UserTypeError, OSError)):
        return str(error) or type(error).__name__
    return f"{type(error).__name__}: {error}"


def run_reporting_errors(prog: str, work: Callable[[], int | None], exit_at_once: bool = False) -> int:
    """`work()`'s exit status (None counts as 0); a user error prints `prog: error: ...` and returns 2.

    `exit_at_once` (for the program's own entry point, never in-process callers): a refusal made before any work
    (`FolderLockedError`: another process writes to the output) ends the process with status 2 right after its
    message, skipping the interpreter's teardown of the loaded libraries
    (torch, Transformers, datasets: 2.5 s of CPU measured, tens of seconds on a loaded machine, where the refused
    run looked as if it kept running)."""
    try:
        return int(work() or 0)
    except Exception as error:
        if not is_user_error(error):
            raise
        print(f"{prog}: error: {describe_user_error(error)}", file=sys.stderr)
        from .folder_lock import FolderLockedError

        if exit_at_once and isinstance(error, FolderLockedError):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(USAGE_ERROR)
        return USAGE_ERROR
