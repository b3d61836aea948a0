"""``print``, ``logging`` and ``warnings.warn`` in the program: run on every call, as in eager.

Capture runs the program once; a ``print(x)`` there would print a fake tensor, once. Instead,
while capturing, ``print``, the ``logging.Logger`` methods and ``warnings.warn`` called from the
program's code (not torch's, keraunos's or the standard library's) are recorded: their tensor
arguments become outputs of the computation (a snapshot, ``x.detach().clone()``, so that later
in-place writes do not show), and the epilogue makes the same call on every call, in program
order, after the computation has run. The text is eager's: a tensor is shown with the autograd
suffix eager's would have (``grad_fn=<MulBackward0>``), a log record carries the program's file
and line, a warning its own location and registry (so Python's "once per location" filters
behave as in eager).

What capture cannot follow is refused as data dependence: formatting a tensor's values into a
string inside the program (``f"{x}"``, ``str(x)``, ``"%s" % x``) makes the text, not a tensor,
the argument. Two exceptions to "every call": a ``logger.warning_once`` (transformers) logs at
capture only, since it logs once per process in eager too; and a logger whose level hides the
message at capture is still asked on every call (the level is checked when the epilogue runs).
"""
from __future__ import annotations

import builtins
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..core.templates import ObjectRef
from ..errors import is_internal, user_source
from .state import active_context

_print = builtins.print
_warn = warnings.warn
_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal",
                "log")
_log_originals = {name: getattr(logging.Logger, name) for name in _LOG_METHODS}


@dataclass
class ReplayedCall:
    """One recorded call: ``function(*fixed, *args, **kwargs)``. ``fixed`` are passed as they
    are (a logger, a warning's registry); in ``args`` and ``kwargs`` (what the program passed)
    tensors are ``Shown`` snapshots and symbolic sizes ``SizeOf``; ``label`` names the call in
    the epilogue, ``source`` is the program's line."""

    function: Callable
    label: str
    fixed: tuple
    args: tuple
    kwargs: dict
    source: Any = None

    def replay(self) -> tuple["Replay", list]:
        """The epilogue's callable, and what it takes on every call, in order: the (fake)
        tensors of the snapshots and the symbolic sizes (``SymInt``, ``torch.Size``)."""
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs), is_leaf=_is_leaf)
        varying = {i: leaf for i, leaf in enumerate(leaves)
                   if isinstance(leaf, (Shown, SizeOf, Passed, Found))}
        constants = [None if i in varying else leaf for i, leaf in enumerate(leaves)]
        slots = [(i, (v.suffix, v.parameter) if isinstance(v, Shown) else None)
                 for i, v in varying.items()]
        values = [v.tensor if isinstance(v, (Shown, Passed)) else ObjectRef(v.path)
                  if isinstance(v, Found) else v.value for v in varying.values()]
        return Replay(self.function, self.fixed, spec, constants, slots), values


@dataclass(frozen=True)
class SizeOf:
    """A symbolic size the program passed (``x.shape[0]``, ``x.shape``): its value on every call."""

    value: Any


@dataclass(frozen=True)
class Passed:
    """A tensor the program passed, given to the call itself (its copy the computation returns)."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Found:
    """An object the program reaches by name, at ``path``: the call gets the one the prologue
    finds there on every call."""

    path: Any


class Replay:
    """Calls the recorded function again with this call's tensors and sizes in their places."""

    def __init__(self, function: Callable, fixed: tuple, spec, constants: list, slots: list):
        self.function, self.fixed, self.spec = function, fixed, spec
        self.constants, self.slots = constants, slots

    def __call__(self, *values):
        leaves = list(self.constants)
        for (i, shown), value in zip(self.slots, values):
            leaves[i] = Shown(value, *shown) if shown is not None else value
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.function(*self.fixed, *args, **kwargs)


class Shown:
    """A tensor as ``print`` and ``logging`` show it in eager: its values (the snapshot the
    computation returned) and the autograd suffix of the tensor the program printed."""

    def __init__(self, tensor: torch.Tensor, suffix: str, parameter: bool):
        self.tensor = tensor
        self.suffix = suffix
        self.parameter = parameter

    def __repr__(self) -> str:
        text = repr(self.tensor)
        if self.suffix:
            text = text[:-1] + self.suffix + ")"
        return "Parameter containing:\n" + text if self.parameter else text

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)


def _autograd_suffix(t: torch.Tensor) -> str:
    if t.grad_fn is not None:
        return f", grad_fn=<{type(t.grad_fn).__name__}>"
    return ", requires_grad=True" if t.requires_grad else ""


def _from_user_code(depth: int) -> bool:
    """Whether the frame ``depth`` levels above the caller of this function is the program's,
    skipping the logging module's own frames; False inside a ``*_once`` logger helper."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("logging"):
        frame = frame.f_back
    if frame is None or is_internal(frame.f_code.co_filename):
        return False
    return not frame.f_code.co_name.endswith("_once")  # transformers' logger.warning_once


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _snapshot(ctx, value):
    """``value`` with every tensor replaced by a ``Shown`` of its copy (recorded: the recording
    mode is on while the program's own code runs) and every symbolic size by a ``SizeOf``."""
    def show(t):
        if isinstance(t, torch.Tensor):
            return Shown(t.detach().clone(), _autograd_suffix(t), isinstance(t, torch.nn.Parameter))
        if isinstance(t, _SYMBOLIC) or isinstance(t, torch.Size) and not all(
                type(n) is int for n in t):
            return SizeOf(t)
        return t
    return pytree.tree_map(show, value, is_leaf=_is_leaf)


def snapshot(value):
    """``value`` with every tensor replaced by a ``Passed`` copy and every symbolic size by a
    ``SizeOf``: the arguments of a call the epilogue makes with values, not text."""
    def passed(t):
        if isinstance(t, torch.Tensor):
            return Passed(t.detach().clone())
        if isinstance(t, _SYMBOLIC) or isinstance(t, torch.Size) and not all(
                type(n) is int for n in t):
            return SizeOf(t)
        return t
    return pytree.tree_map(passed, value, is_leaf=_is_leaf)


def _is_leaf(x) -> bool:  # a shape prints as torch.Size([...])
    return isinstance(x, (Shown, SizeOf, Passed, Found, torch.Size))


def _recording_print(*args, **kwargs):
    ctx = active_context()
    if ctx is None or not _from_user_code(1):
        return _print(*args, **kwargs)
    ctx.replayed_calls.append(ReplayedCall(_print, "print", (), _snapshot(ctx, args),
                                           _snapshot(ctx, kwargs), user_source()))
    return None


def replay_log(logger: logging.Logger, level: int, filename: str, lineno: int, function: str,
               msg, args, extra=None) -> None:
    """What ``logger.<level>(msg, *args)`` at ``filename:lineno`` does, for the epilogue."""
    if logger.isEnabledFor(level):
        logger.handle(logger.makeRecord(logger.name, level, filename, lineno, msg, args, None,
                                        function, extra))


def _recording_log_method(name: str):
    original = _log_originals[name]
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "warn": logging.WARNING, "error": logging.ERROR, "exception": logging.ERROR,
              "critical": logging.CRITICAL, "fatal": logging.CRITICAL}

    def method(self, *args, **kwargs):
        ctx = active_context()
        if ctx is None or not _from_user_code(1):
            return original(self, *args, **kwargs)
        if name == "log":
            level, msg, *rest = args
        else:
            level, (msg, *rest) = levels[name], args
        exc_info = kwargs.get("exc_info", name == "exception")
        if exc_info:  # the exception being handled now, at capture: not one of a later call
            return original(self, *args, **kwargs)
        frame = sys._getframe(1)
        while frame.f_globals.get("__name__", "").startswith("logging"):
            frame = frame.f_back
        fixed = (self, level, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        ctx.replayed_calls.append(ReplayedCall(
            replay_log, f"log_{name}", fixed, _snapshot(ctx, (msg, tuple(rest))),
            {"extra": kwargs.get("extra")}, user_source()))
        return None
    method.__name__ = name
    method.__wrapped__ = original
    return method


def _recording_warn(message, category=None, stacklevel=1, source=None, *, skip_file_prefixes=()):
    ctx = active_context()
    if ctx is None or not _from_user_code(1) or skip_file_prefixes:
        return _warn(message, category, stacklevel + 1, source)
    if isinstance(message, Warning):
        category = type(message)
    category = category or UserWarning
    frame = sys._getframe(1)
    for _ in range(stacklevel - 1):
        if frame.f_back is None:
            break
        frame = frame.f_back
    module_globals = frame.f_globals
    registry = module_globals.setdefault("__warningregistry__", {})
    ctx.replayed_calls.append(ReplayedCall(
        warnings.warn_explicit, "warn",
        (message, category, frame.f_code.co_filename, frame.f_lineno,
         module_globals.get("__name__", "<unknown>"), registry, module_globals), (), {},
        user_source()))
    return None


_CONCRETE = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _specializing(cls, name: str):
    """``SymInt.__format__`` (and the rest) during capture: text the program makes of a symbolic
    size (``f"{x.shape}"``) holds its value, so the value is fixed (a size guard the prologue
    checks: another value recompiles); torch's own formatting of symbols is left alone."""
    original = cls.__dict__[name]
    concrete = _CONCRETE[cls]

    def method(self, *args):
        if active_context() is not None and _from_user_code(1):
            return getattr(concrete(self), name)(*args)
        return original(self, *args)
    method.__name__ = name
    return method


_SYMBOL_TEXT = [(cls, name, _specializing(cls, name), cls.__dict__[name])
                for cls in _CONCRETE for name in ("__repr__", "__str__", "__format__")
                if name in cls.__dict__]


# (owner, attribute, stand-in during capture, original), for interceptors.intercepting_torch
SWAPS = [(builtins, "print", _recording_print, _print),
         (warnings, "warn", _recording_warn, _warn)] + [
    (logging.Logger, name, _recording_log_method(name), _log_originals[name])
    for name in _LOG_METHODS] + _SYMBOL_TEXT
