"""torch.fx's private parts: the flag for a symbolic trace under way (``torch.fx.Tracer.trace``
sets it; a ``torch.compile``'d function called while it is set refuses to run), and the lazily
compiled ``GraphModule`` dynamo hands a backend (``LazyGraphModule``).

Release difference: up to torch 2.13 the flag is one module global, which a trace on any thread
sets for every thread; from 2.14 each thread has its own. ``flag_is_per_thread`` says which this
torch has. Either way ``tracing`` reads the calling thread's view of it and ``set_tracing`` sets
it (a per-thread flag held in a ``threading.local`` as its ``value``); where it is per thread in
another form, only a trace on the calling thread can have changed it (and that trace puts it
back), so ``set_tracing`` leaves it and ``tracing`` reads False.
"""
from __future__ import annotations

import threading

from torch.fx import _symbolic_trace
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule

_FLAG = "_is_fx_tracing_flag"


def flag_is_per_thread() -> bool:
    """Whether torch.fx keeps the flag per thread (torch 2.14 on), not in one module global."""
    return not isinstance(getattr(_symbolic_trace, _FLAG, None), bool)


def tracing() -> bool:
    """Whether torch.fx says a symbolic trace is under way, as the calling thread sees it.
    (Read here rather than through torch.fx's ``is_fx_tracing()``, which logs a deprecation.)"""
    flag = getattr(_symbolic_trace, _FLAG, False)
    if isinstance(flag, threading.local):
        return bool(getattr(flag, "value", False))
    return bool(flag)


def set_tracing(value: bool) -> None:
    """Set the flag as the calling thread sees it (to put back what a trace left set)."""
    if not flag_is_per_thread():
        setattr(_symbolic_trace, _FLAG, value)
        return
    holder = getattr(_symbolic_trace, _FLAG, None)
    if isinstance(holder, threading.local) and hasattr(holder, "value"):
        holder.value = value


__all__ = ["LazyGraphModule", "flag_is_per_thread", "set_tracing", "tracing"]
