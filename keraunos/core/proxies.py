"""Proxies: named stand-ins for the values a trace computes or receives.

A ``TensorProxy`` carries the metadata of the tensor it stands for (shape, stride, dtype, device,
requires_grad), the tags passes and transforms read, and, for trace inputs, its provenance: the
Python expression that finds it from what the user passed (``args[0]``, ``module.lm_head.weight``).
A ``NumberProxy`` is a symbolic size or int (``s0``) of an entry compiled with symbolic sizes.
Every other value in a trace (numbers, strings, dtypes, shapes) is a constant: in the "constant
values" cache mode the prologue checks that it is the same on every call.
"""
from __future__ import annotations

import torch

from .symbolic import print_expression
from .tags import Tag

_DTYPE_ABBREVIATIONS = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


class Proxy:
    """A named value in a trace. ``name`` is unique within one compilation."""

    __slots__ = ("name", "tags", "provenance")

    def __init__(self, name: str, tags: set[Tag] | None = None, provenance: str | None = None):
        self.name = name
        self.tags = set(tags) if tags else set()
        self.provenance = provenance

    def __repr__(self) -> str:
        return self.name

    def describe(self) -> str:
        return ""


class TensorProxy(Proxy):
    """A tensor in a trace, with the metadata its computation was captured for."""

    __slots__ = ("shape", "stride", "dtype", "device", "requires_grad", "storage", "_storage")

    def __init__(self, name: str, tensor: torch.Tensor, tags=None, provenance=None):
        super().__init__(name, tags, provenance)
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.requires_grad = tensor.requires_grad
        # Which capture-time storage the tensor lives in: tensors that share one are views of each
        # other, which passes must respect when the program writes in place. The number is the
        # storage's address, so the proxy keeps the (fake) storage alive: a storage freed after
        # capture would let one the autograd split makes take its address, and unrelated values
        # would look like views of each other (regions cut at random places, CSE and DCE held back).
        try:
            self._storage = tensor.untyped_storage()
            self.storage = self._storage._cdata
        except Exception:
            self._storage = self.storage = None

    def describe(self) -> str:
        dtype = _DTYPE_ABBREVIATIONS.get(self.dtype, str(self.dtype).removeprefix("torch."))
        grad = " requires_grad" if self.requires_grad else ""
        shape = ", ".join(map(_size_text, self.shape))
        return f'"{self.device.type} {dtype}[{shape}]{grad}"'


def _size_text(size) -> str:
    """A size as traces print it: ``64``, or a symbolic size in the trace's names (``2*s0``)."""
    if type(size) is int:
        return str(size)
    names = getattr(getattr(size.node, "shape_env", None), "keraunos_names", None)
    if names:  # the symbols capture named (see capture/symbolic.py)
        return print_expression(size.node.expr, names)
    return str(size)


class NumberProxy(Proxy):
    """A Python number that is a symbol of the trace (a symbolic size ``s0``, an int argument):
    the prologue reads it from the call and the computation receives it. ``value`` is the
    ``SymInt`` it stood for during capture, ``symbol`` its ``ShapeEnv`` symbol."""

    __slots__ = ("python_type", "value", "symbol")

    def __init__(self, name: str, python_type: type, value=None, symbol=None, tags=None,
                 provenance=None):
        super().__init__(name, tags, provenance)
        self.python_type = python_type
        self.value = value
        self.symbol = symbol

    def describe(self) -> str:
        return self.python_type.__name__


class ObjectProxy(Proxy):
    """A non-tensor input the prologue hands on (a module, a container of the user's)."""

    __slots__ = ("python_type",)

    def __init__(self, name: str, python_type: type, tags=None, provenance=None):
        super().__init__(name, tags, provenance)
        self.python_type = python_type

    def describe(self) -> str:
        return self.python_type.__name__


class NameGenerator:
    """Hands out unique names for one compilation: ``t0, t1, ...`` or sanitised user names."""

    def __init__(self):
        self._used: set[str] = set()
        self._counter = 0
        self._suffix: dict[str, int] = {}  # base -> the last suffix tried (32 layers' weights)

    def fresh(self, hint: str | None = None) -> str:
        if hint:
            base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint).strip("_") or "v"
            if base[0].isdigit():
                base = "_" + base
            if base in _RESERVED:
                base = base + "_"
            name, i = base, self._suffix.get(base, 0)
            if i:
                name = f"{base}_{i}"
            while name in self._used:
                i += 1
                name = f"{base}_{i}"
            self._suffix[base] = i
            self._used.add(name)
            return name
        while True:
            name = f"t{self._counter}"
            self._counter += 1
            if name not in self._used:
                self._used.add(name)
                return name



_RESERVED = {
    "torch", "args", "kwargs", "module", "self", "inputs", "outputs", "pro_to_epi", "None", "True",
    "False", "del", "return", "if", "not", "and", "or", "in", "is", "for", "while", "def", "class",
    "lambda", "with", "as", "import", "from", "global", "pass", "try", "except", "finally", "raise",
    "yield", "assert", "break", "continue", "elif", "else", "nonlocal", "async", "await", "type",
    "len", "id", "object", "float", "int", "str", "bool", "list", "tuple", "dict", "input",
}
