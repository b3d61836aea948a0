"""One way to write a pass: a function from a trace to the new trace's lines, registered with
its label. The runner times it and derives the new trace, whose header names the pass.

    >>> from keraunos.passes.runner import trace_pass
    >>> @trace_pass("Drop Nothing")
    ... def drop_nothing(trace):
    ...     return list(trace.bound_symbols)
    >>> drop_nothing.label
    'Drop Nothing'

``drop_nothing(trace)`` then returns a new ``Trace`` whose last header line is
``Constructed by Drop Nothing (took 0.01 ms)``. A pass never mutates the trace it is given.
"""
from __future__ import annotations

import functools
import time
from typing import Callable

# Label -> the registered pass, in the order they were defined.
PASSES: dict[str, Callable] = {}


def trace_pass(label: str):
    """Make ``fn(trace, ...) -> list[BoundSymbol]`` a pass ``trace -> Trace`` named ``label``."""
    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(trace, *args, **kwargs):
            start = time.perf_counter()
            lines = fn(trace, *args, **kwargs)
            return trace.derive(lines, label, time.perf_counter() - start)
        run.label = label
        PASSES[label] = run
        return run
    return register
