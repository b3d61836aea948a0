"""One thread at a time traces and lowers: the turns that fused compiles and Dynamo's compiles take.

``compiler`` takes a turn around each region's compile; Dynamo's compiles on any thread take one
through its compile callbacks (``dynamo_takes_turns``, registered by the warming thread and before
every fused compile). ``_Turns`` says why.
"""
from __future__ import annotations

import contextlib
import threading


class _Turns:
    """One thread at a time traces and lowers: Inductor's compile (AOTAutograd's ``make_fx``) and
    Dynamo's both run torch.fx's tracer, whose patcher is one module global
    (``torch.fx._symbolic_trace.CURRENT_PATCHER``): two traces at once on two threads undo each
    other's patches and one of them fails ("CURRENT_PATCHER is None in finally block"), a fused
    region on the worker (run unfused, with a warning) or the caller's own ``torch.compile``.
    Re-entrant on one thread (a Dynamo compile calls the keraunos backend, which compiles
    regions); a turn may be given back by another thread than took it (Dynamo runs its end
    callbacks on the thread whose compile ends last). Dynamo calls its start callbacks holding
    its own counter lock, so a compile that holds a turn must not start Dynamo's callbacks
    itself: region compiles are inference graphs without CUDA graphs, which never do (only
    AOTAutograd's lazy backward compile and cudagraph trees call ``install_callbacks``)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._owner: int | None = None
        self._depth = 0

    def take(self) -> None:
        me = threading.get_ident()
        with self._changed:
            while self._owner is not None and self._owner != me:
                self._changed.wait()
            self._owner = me
            self._depth += 1

    def give_back(self) -> None:
        with self._changed:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                self._owner = None
                self._changed.notify_all()

    @contextlib.contextmanager
    def turn(self):
        self.take()
        try:
            yield
        finally:
            self.give_back()


tracing = _Turns()


def dynamo_takes_turns() -> None:
    """Dynamo's compiles on any thread take ``tracing`` too, through its compile start and end
    callbacks (registered again after ``torch._dynamo.reset()``, which clears them, at the next
    fused compile)."""
    from torch._dynamo.callback import callback_handler
    if _take_for_dynamo not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_take_for_dynamo)
        callback_handler.register_end_callback(_give_back_for_dynamo)


# Turns Dynamo's start callbacks took and its end callbacks have not given back. An end callback
# can come without its start: the callbacks are registered when fusion first warms up, which may
# be inside a Dynamo compile already started (the keraunos backend's); that end must not give back
# a turn a fused compile holds.
_dynamo_turns = [0]
_dynamo_turns_lock = threading.Lock()


def _take_for_dynamo(args) -> None:
    tracing.take()
    with _dynamo_turns_lock:
        _dynamo_turns[0] += 1


def _give_back_for_dynamo(args) -> None:
    with _dynamo_turns_lock:
        if not _dynamo_turns[0]:
            return
        _dynamo_turns[0] -= 1
    tracing.give_back()
