"""How many graphs torch.compile compiled during a timed call: a compiled row whose warm-up did not settle.

A compiled method's graphs are compiled by the bench's untimed warm-up; a graph compiled while the call is timed
means the warm-up did not settle (a guard that fails every step, such as a Python int that changes per token), so
its seconds hold compiles, or, past dynamo's recompile limit, eager steps: not a compiled row's speed.
"""

from __future__ import annotations

from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler

__all__ = ["CompileCounter"]


class CompileCounter:
    """Context manager counting dynamo's compiles while it is open (`count`): every frame dynamo starts to
    compile, a recompile after a failed guard included (torch 2.13's compile-start callbacks,
    `torch._dynamo.callback`; cudagraph recordings and deferred backward compiles are not counted)."""

    def __init__(self):
        self.count = 0

    def _started(self, args: CallbackArgs) -> None:
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.count += 1

    def __enter__(self) -> CompileCounter:
        callback_handler.register_start_callback(self._started)
        return self

    def __exit__(self, *exc) -> None:
        callback_handler.remove_start_callback(self._started)
