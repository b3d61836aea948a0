"""User-facing transforms: bundles of hooks called at fixed points of compilation.

Subclass ``Transform`` and override any hook; each defaults to doing nothing.

    >>> import keraunos, torch
    >>> class Log(keraunos.Transform):
    ...     def transform_trace_post_optimization(self, trace):
    ...         print(len(trace.bound_symbols), "lines")
    ...         return trace
    >>> f = keraunos.jit(lambda x: x * 2, transforms=[Log()])
"""
from __future__ import annotations

from ..core.trace import Trace


class Transform:
    """Hooks into compilation. ``jit(fn, transforms=[...])`` applies them in order."""

    def transform_module(self, jitted_module) -> None:
        """Called once, at ``jit()`` of a module, with the jitted module."""

    def transform_traces_pre_prologue(self, prologue: Trace, computation: Trace,
                                      epilogue: Trace) -> tuple[Trace, Trace, Trace]:
        """Called on each cache miss, after capture; returns the three traces to use."""
        return prologue, computation, epilogue

    def transform_trace_post_optimization(self, trace: Trace) -> Trace:
        """Called on each cache miss, after executors claimed the operations, for the forward
        computation (and, once autograd produces one, the backward)."""
        return trace

    @property
    def name(self) -> str:
        return type(self).__name__
