"""The pass runner: every step from traces to traces is labelled, timed and linted here.

Two ways to write a step. A *pass* is a function from a trace to the new trace's lines,
registered with its label; the runner times it and derives the new trace, whose header names the
pass:

    >>> from keraunos.core.runner import trace_pass
    >>> @trace_pass("Drop Nothing")
    ... def drop_nothing(trace):
    ...     return list(trace.bound_symbols)
    >>> drop_nothing.label
    'Drop Nothing'

``drop_nothing(trace)`` then returns a new ``Trace`` whose last header line is
``Constructed by Drop Nothing (took 0.01 ms)``. A *step* (``@trace_step``) makes several traces
at once (the autograd split's forward and backward, reinplace's computation and epilogue), each
with ``Trace.derive(lines, label)``; the runner stamps the traces it returns that the step made
with the time the step took. ``Trace.derive`` lints each new trace (``KERAUNOS_LINT=1``). A step
never mutates the traces it is given. Nothing else in passes/, executors/ or autograd/ reads the
clock: ``stopwatch`` is for the compile times that are not a trace's (a kernel's build).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator

from .trace import Trace

# Label -> the registered pass, in the order they were defined.
PASSES: dict[str, Callable] = {}


def trace_pass(label: str):
    """Make ``fn(trace, ...) -> list[BoundSymbol]`` a pass ``trace -> Trace`` named ``label``."""
    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(trace, *args, **kwargs):
            with stopwatch() as elapsed:
                lines = fn(trace, *args, **kwargs)
            return trace.derive(lines, label, elapsed())
        run.label = label
        PASSES[label] = run
        return run
    return register


def trace_step(fn: Callable) -> Callable:
    """Time ``fn``, which returns new traces (alone, in a tuple, or as fields of a dataclass,
    or of one it holds)
    made by ``Trace.derive(lines, label)``: each one it made gets the time of the call."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        given = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, Trace)}
        with stopwatch() as elapsed:
            result = fn(*args, **kwargs)
        seconds = elapsed()
        for trace in _traces_in(result):
            if id(trace) not in given and trace.untimed():
                trace.stamp(seconds)
        return result
    return run


def _traces_in(result) -> Iterator[Trace]:
    if isinstance(result, Trace):
        yield result
    elif isinstance(result, (tuple, list)):
        for r in result:
            if isinstance(r, Trace):
                yield r
    elif dataclasses.is_dataclass(result) and not isinstance(result, type):
        for f in dataclasses.fields(result):  # and those of a dataclass it holds
            yield from _traces_in(getattr(result, f.name))


@contextlib.contextmanager
def stopwatch():
    """``with stopwatch() as elapsed: ...``, then ``elapsed()``: the seconds the block took."""
    start = time.perf_counter()
    end = None

    def elapsed() -> float:
        return (end if end is not None else time.perf_counter()) - start
    try:
        yield elapsed
    finally:
        end = time.perf_counter()
