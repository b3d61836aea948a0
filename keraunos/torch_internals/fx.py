"""torch.fx's private parts: the flag for a symbolic trace under way (``torch.fx.Tracer.trace``
sets it; a ``torch.compile``'d function called while it is set refuses to run), and the lazily
compiled ``GraphModule`` dynamo hands a backend (``LazyGraphModule``).

Release difference: up to torch 2.13 the flag is one module global (``_is_fx_tracing_flag``),
which a trace on any thread sets for every thread; from 2.14 each thread has its own, read and set
through ``_get_is_fx_tracing``/``_set_is_fx_tracing``. ``flag_is_per_thread`` says which this torch
has; ``tracing`` and ``set_tracing`` read and set the calling thread's view of it either way.
"""
from __future__ import annotations

from torch.fx import _symbolic_trace
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule

_FLAG = "_is_fx_tracing_flag"                    # to torch 2.13
_GET, _SET = "_get_is_fx_tracing", "_set_is_fx_tracing"  # from torch 2.14


def flag_is_per_thread() -> bool:
    """Whether torch.fx keeps the flag per thread (torch 2.14 on), not in one module global."""
    return hasattr(_symbolic_trace, _GET) and hasattr(_symbolic_trace, _SET)


def tracing() -> bool:
    """Whether torch.fx says a symbolic trace is under way, as the calling thread sees it.
    (Read here rather than through torch.fx's ``is_fx_tracing()``, which logs a deprecation.)"""
    if flag_is_per_thread():
        return bool(getattr(_symbolic_trace, _GET)())
    return bool(getattr(_symbolic_trace, _FLAG, False))


def set_tracing(value: bool) -> None:
    """Set the flag as the calling thread sees it (to put back what a trace left set)."""
    if flag_is_per_thread():
        getattr(_symbolic_trace, _SET)(value)
    else:
        setattr(_symbolic_trace, _FLAG, value)


__all__ = ["LazyGraphModule", "flag_is_per_thread", "set_tracing", "tracing"]
