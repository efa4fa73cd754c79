"""Ctrl-C always stops a command, even where a library swallows the `KeyboardInterrupt` it raises.

Python raises `KeyboardInterrupt` wherever the main thread happens to run when SIGINT arrives; when that is a
finalizer (`__del__`, a weakref callback: "Exception ignored in ...") or a library's broad `except`, the exception
is lost and the work goes on (the recipe once finished every stage and exited 0 after a Ctrl-C during its
regeneration). The command line records every SIGINT (`recording_interrupts`); long loops call
`raise_if_interrupted` at their resumable boundaries (a recipe stage, a regeneration shard), and `main` exits 130
when an interrupt was recorded, whatever the work returned.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["INTERRUPTED", "interrupted", "raise_if_interrupted", "recording_interrupts"]

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)
_state = {"interrupted": False}


def _on_sigint(signum, frame) -> None:
    _state["interrupted"] = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether SIGINT arrived while `recording_interrupts` was active."""
    return _state["interrupted"]


def raise_if_interrupted(where: str) -> None:
    """KeyboardInterrupt when a SIGINT was recorded, even if the one it raised was swallowed: call it at the
    boundaries where stopping leaves resumable work (`where` names the boundary)."""
    if _state["interrupted"]:
        raise KeyboardInterrupt(f"interrupted (Ctrl-C); stopped {where}")


@contextlib.contextmanager
def recording_interrupts() -> Iterator[None]:
    """Record every SIGINT for the block (raising KeyboardInterrupt as Python's own handler does). A no-op
    outside the main thread, or where SIGINT is not Python's default handler (ignored under nohup, or the
    caller's own handler)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    _state["interrupted"] = False
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
