"""What a compile collects from Inductor, through two of its functions replaced while keraunos
compiles or loads (``patches``): the wrapper modules it generates
(``GraphLowering.save_output_code``), and its waits for their C++ kernels (``AsyncCompile.wait``), put off so that g++ builds while the compile goes on and a
module's kernels are built by one g++ run (``one_build``). Both the compiling thread
(``compiler``) and a compile helper process (``workers``) collect this way, so a helper builds
the kernels as the parent's load of its module will ask for them."""
from __future__ import annotations

import contextlib
import functools
import threading

from . import one_build


# What this thread's compile collects from Inductor's replaced functions (below): its generated
# wrappers and its put-off waits. Thread-local: compiles in two threads at once each collect
# their own, and a thread that collects nothing gets Inductor's own behaviour.
_collecting = threading.local()


def waiting(original_wait):
    """``AsyncCompile.wait``'s replacement (``patches``). Inductor waits for a wrapper's C++
    kernels there when it loads the wrapper (a compile, or a module from keraunos's store).
    Within ``from_inductor`` on a thread, the wait is recorded instead of done; elsewhere it is
    Inductor's own (after the one build of what was collected, if anything was)."""
    def wait(self, scope):
        finish = one_build.start()  # the module's kernels, collected: one g++ build
        pending = getattr(_collecting, "pending", None)
        if pending is None:
            return _finish_then_wait(finish, original_wait, self, scope)
        pending.append((functools.partial(_finish_then_wait, finish, original_wait, self),
                        scope))
    return wait


def _finish_then_wait(finish, original_wait, async_compile, scope) -> None:
    if finish is not None:
        finish(scope)  # the merged build's kernels into the module's globals (``one_build``)
    original_wait(async_compile, scope)


def saving(previous_save):
    """``GraphLowering.save_output_code``'s replacement (``patches``, while compiling): Inductor
    hands it each generated wrapper (on a fresh compile and on both cache hits). Within
    ``from_inductor`` on a thread the wrapper is kept; it is passed on to a hook already set."""
    def save(code: str) -> None:
        sources = getattr(_collecting, "sources", None)
        if sources is not None:
            sources.append(code)
        if previous_save is not None:
            previous_save(code)
    return save


@contextlib.contextmanager
def from_inductor():
    """Within it, this thread's compile keeps Inductor's generated wrappers and puts off its
    waits for their C++ kernels: the kernels stay futures in the wrapper module's globals until
    ``Kernel.ready`` waits for them, and g++ works on them meanwhile; a module's kernels are built
    by one g++ run (``one_build``). Yields (sources, pending). Collects only where
    ``patches.applied()`` has Inductor's functions replaced."""
    _collecting.sources, _collecting.pending = [], []
    try:
        with one_build.collecting():
            yield _collecting.sources, _collecting.pending
    finally:
        _collecting.sources = _collecting.pending = None
