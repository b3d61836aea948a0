"""What a compile collects from Inductor, through two hooks installed once per process: the
wrapper modules it generates (``GraphLowering.save_output_code``), and its waits for their C++
kernels (``AsyncCompile.wait``), put off so that g++ builds while the compile goes on and a
module's kernels are built by one g++ run (``one_build``). Both the compiling thread
(``compiler``) and a compile helper process (``workers``) collect this way, so a helper builds
the kernels as the parent's load of its module will ask for them."""
from __future__ import annotations

import contextlib
import functools
import threading

from . import one_build


# What this thread's compile collects from Inductor's hooks (below): its generated wrappers and
# its put-off waits. Thread-local, and the hooks are installed once: compiles in two threads at
# once each collect their own, and neither restores a hook the other set.
_collecting = threading.local()
_hooks_lock = threading.Lock()
_hooked: list[str] = []  # which of the two hooks below are installed


def _hook_waits() -> None:
    """Inductor waits for a wrapper's C++ kernels in ``AsyncCompile.wait`` when it loads the
    wrapper (a compile, or a module from keraunos's store). Within ``from_inductor``
    on a thread, the wait is recorded instead of done; elsewhere it is Inductor's own."""
    from torch._inductor.async_compile import AsyncCompile
    with _hooks_lock:
        if "waits" in _hooked:
            return
        original_wait = AsyncCompile.wait

        def wait(self, scope):
            finish = one_build.start()  # the module's kernels, collected: one g++ build
            pending = getattr(_collecting, "pending", None)
            if pending is None:
                return _finish_then_wait(finish, original_wait, self, scope)
            pending.append((functools.partial(_finish_then_wait, finish, original_wait, self),
                            scope))
        AsyncCompile.wait = wait
        _hooked.append("waits")


def _finish_then_wait(finish, original_wait, async_compile, scope) -> None:
    if finish is not None:
        finish(scope)  # the merged build's kernels into the module's globals (``one_build``)
    original_wait(async_compile, scope)


def hook_sources() -> None:
    """Inductor hands each generated wrapper to ``GraphLowering.save_output_code`` (on a fresh
    compile and on both cache hits). Within ``from_inductor`` on a thread, the
    wrapper is kept (and passed on to a hook already set). Installed by the first compile, not
    by a load from the store: ``torch._inductor.graph`` imports Inductor's lowering (about half
    a second), which a process that only loads stored regions never needs."""
    from torch._inductor.graph import GraphLowering
    with _hooks_lock:
        if "sources" in _hooked:
            return
        previous_save = GraphLowering.save_output_code

        def save(code: str) -> None:
            sources = getattr(_collecting, "sources", None)
            if sources is not None:
                sources.append(code)
            if previous_save is not None:
                previous_save(code)
        GraphLowering.save_output_code = save
        _hooked.append("sources")


@contextlib.contextmanager
def from_inductor():
    """Within it, this thread's compile keeps Inductor's generated wrappers and puts off its
    waits for their C++ kernels: the kernels stay futures in the wrapper module's globals until
    ``Kernel.ready`` waits for them, and g++ works on them meanwhile; a module's kernels are built
    by one g++ run (``one_build``). Yields (sources, pending)."""
    _hook_waits()
    _collecting.sources, _collecting.pending = [], []
    try:
        with one_build.collecting():
            yield _collecting.sources, _collecting.pending
    finally:
        _collecting.sources = _collecting.pending = None
