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

from ..core.glue import CHECK, CHECK_ALIAS, CHECK_TENSOR
from ..core.tags import INPUT_TENSOR, MODULE_CHECK, STATIC_MEMORY_LOCATION
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


def _without(trace: Trace, drop) -> Trace:
    """``trace`` without the lines ``drop`` selects (the caller labels the result)."""
    return Trace(trace.name, list(trace.params), [b for b in trace.bound_symbols if not drop(b)],
                 list(trace.header), dict(trace.namespace))


class ExtractionOnlyPrologueTransform(Transform):
    """Stop checking the metadata of parameters and buffers on every call; keep extracting them.

    The prologue still takes each parameter and buffer from the module on every call (so a
    replaced parameter is used), still checks module attributes (``training``, hyperparameters)
    and, unless ``skip_check_on_input_tensors=True``, the call's tensor arguments.

    What you promise in exchange: you will not change the shape, dtype, device, strides or
    ``requires_grad`` of any parameter or buffer (no ``model.half()``, ``.to(...)``, freezing with
    ``requires_grad_(False)``, resizing a buffer) while using this jitted module; with
    ``skip_check_on_input_tensors=True``, also that every call passes tensor arguments with the
    metadata of the call that compiled the entry. Break the promise and the cached program runs
    on tensors it was not compiled for: wrong results or an error, not a recompile.

    >>> import torch, keraunos
    >>> from keraunos.transforms import ExtractionOnlyPrologueTransform
    >>> jm = keraunos.jit(torch.nn.Linear(4, 4), transforms=[ExtractionOnlyPrologueTransform()])
    >>> out = jm(torch.randn(2, 4))
    """

    def __init__(self, skip_check_on_input_tensors: bool = False):
        self.skip_check_on_input_tensors = skip_check_on_input_tensors

    def transform_traces_pre_prologue(self, prologue, computation, epilogue):
        dropped = {STATIC_MEMORY_LOCATION}
        if self.skip_check_on_input_tensors:
            dropped.add(INPUT_TENSOR)

        def drop(b):
            return b.symbol is CHECK_TENSOR and bool(b.args[0].tags & dropped)
        return _without(prologue, drop), computation, epilogue


class PrunePrologueChecks(Transform):
    """Drop every prologue check derived only from the module: parameter and buffer metadata,
    submodule types, module attributes (``training``, ``eps``, config fields). Checks of the
    call's arguments and of global state stay.

    What you promise in exchange: the module will not change in any way the program can see
    while using this jitted module: no ``train()``/``eval()`` switch, no attribute or
    hyperparameter change, no replaced submodule, no parameter or buffer changing dtype, device
    or shape. (Replaced parameters and buffers are still picked up: extraction stays.)
    """

    def transform_traces_pre_prologue(self, prologue, computation, epilogue):
        def drop(b):
            if b.symbol is CHECK_TENSOR:
                return STATIC_MEMORY_LOCATION in b.args[0].tags
            return (b.symbol is CHECK or b.symbol is CHECK_ALIAS) and MODULE_CHECK in b.tags
        return _without(prologue, drop), computation, epilogue


__all__ = ["Transform", "ExtractionOnlyPrologueTransform", "PrunePrologueChecks"]
