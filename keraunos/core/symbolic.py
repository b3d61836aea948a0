"""Symbolic values in traces: a size expression over the size symbols (``SymbolicValue``), its
printing in a trace's names, and comparing sizes without recording guards.

A trace holds these; ``capture/symbolic.py`` decides which sizes are symbolic and turns the
``ShapeEnv``'s facts into the prologue's checks.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._sympy.printers import PythonPrinter

from .code import Code

SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


class SymbolicUnsupported(Exception):
    """Raised during a symbolic capture for what it does not handle yet; the entry is then
    compiled with exact sizes instead (never an error to the user)."""


class SymbolicValue(Code):
    """A size expression in a trace (``2*s0``): printed as Python over the size symbols, with the
    ``SymInt`` it stands for (``value``) and the symbols it reads (``proxies``)."""

    value: Any
    proxies: tuple

    def __new__(cls, text: str, value, proxies):
        self = super().__new__(cls, text)
        self.value = value
        self.proxies = tuple(proxies)
        return self


class SizePrinter(PythonPrinter):
    def __init__(self, names: dict, strict: bool = True):
        super().__init__()
        self.names = names
        self.strict = strict

    def _print_Symbol(self, expr) -> str:
        name = self.names.get(expr)
        if name is None:  # a symbol with no place to read it from (data-dependent)
            if not self.strict:
                return str(expr)
            raise SymbolicUnsupported(f"the size {expr} is not read from any input")
        return name


def print_expression(expr, names: dict) -> str:
    """A size expression in the trace's names, for reading (data-dependent sizes as ``u0``)."""
    return SizePrinter(names, strict=False).doprint(expr)


def as_code(value, proxies: dict) -> SymbolicValue | Any:
    """``value`` as a trace value: a ``SymInt`` (``SymFloat``, ``SymBool``) over the symbols of
    ``proxies`` (symbol -> its ``NumberProxy``) becomes a ``SymbolicValue``, one a guard made a
    constant becomes that constant; anything else is returned unchanged. Raises
    ``SymbolicUnsupported`` for sizes that depend on tensor data."""
    if not isinstance(value, SYMBOLIC_TYPES):
        return value
    expr = value.node.expr
    if expr.is_number:  # specialized to a constant by a guard the prologue checks
        if isinstance(value, torch.SymBool):
            return bool(expr)
        return int(expr) if isinstance(value, torch.SymInt) else float(expr)
    used = sorted(expr.free_symbols, key=str)
    if not all(s in proxies for s in used):
        raise SymbolicUnsupported(f"the size {expr} depends on tensor data")
    printer = SizePrinter({s: proxies[s].name for s in used})
    return SymbolicValue(printer.doprint(expr), value, [proxies[s] for s in used])


def is_backed(value, proxies: dict) -> bool:
    """Whether a symbolic value is an expression of the given symbols (not of tensor data)."""
    return value.node.expr.free_symbols <= set(proxies)


def has_symbols(fake) -> bool:
    """Whether a fake tensor's sizes, strides or offset are symbolic."""
    return any(isinstance(v, torch.SymInt) for v in (*fake.shape, *fake.stride(),
                                                      fake.storage_offset()))


def expr_key(value):
    """A size as something to compare without guarding: its expression when symbolic
    (``==`` on ``SymInt``s would record a guard in the ``ShapeEnv``)."""
    return value.node.expr if isinstance(value, SYMBOLIC_TYPES) else value


def layout_key(fake) -> tuple:
    """Sizes and strides of a fake tensor, comparable without guarding."""
    return (*map(expr_key, fake.shape), *map(expr_key, fake.stride()))


def hint(value):
    """The capture-time value of a symbolic int (the int itself for a plain one)."""
    return value.node.hint if isinstance(value, SYMBOLIC_TYPES) else value


def refuse_raw_symbols(trace) -> None:
    """A ``SymInt`` left in a trace as a constant would run with its capture-time value (or
    fail): raise ``SymbolicUnsupported`` instead, so that the entry is compiled otherwise."""
    seen: set[int] = set()

    def visit(x):
        if id(x) in seen or isinstance(x, (str, int, float, type(None), torch.Tensor)):
            return
        seen.add(id(x))
        if isinstance(x, SYMBOLIC_TYPES):
            raise SymbolicUnsupported(f"a symbolic value {x} reached {trace.name} as a constant")
        if isinstance(x, (tuple, list)):
            for v in x:
                visit(v)
        elif type(x) is slice:
            visit((x.start, x.stop, x.step))
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(k)
                visit(v)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # epilogue templates
            visit([getattr(x, f.name, None) for f in dataclasses.fields(x)])
    for b in trace.bound_symbols:
        visit((b.args, b.kwargs))
