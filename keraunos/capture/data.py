"""Data specialization (``jit(..., specialize_data=True)``): Python values read from tensor data.

It owns what capture has read from tensor data so far: the size symbol of each int read that
varies, by what computes it (so that the same read made again, by each layer of a model, gets
the same symbol), and the places in the user's code of those reads (a read's place among the
reads of its line names it). The value itself is computed from the real inputs with the
recorded lines that lead to it; the prologue recomputes it on every call.
"""
from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from ..torch_internals.dispatch import DisableTorchFunction
from ..core.proxies import TensorProxy
from ..core.symbolic import SYMBOLIC_TYPES, SymbolicUnsupported
from ..core.symbolic import hint as size_hint
from ..core.symbols import BoundSymbol, Code
from ..core.tags import MUTATION, OPAQUE, RANDOM
from ..errors import CaptureError, user_source
from . import guards
from .guards import DataRead, Guard
from .symbolic import data_read_description


class DataSpecialization:
    """The reads from tensor data of one capture. ``ctx`` is the ``CaptureContext`` that owns
    it: the recorded lines, the inputs, the storages written, ``dynamic`` and ``symbols``, and
    the guards (a constant read adds a data guard)."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._symbols_by_read: dict[tuple, Any] = {}  # _read_key -> the SymInt the program got
        self._places: list = []  # (file, line) of each read made a symbol, in order

    def specialize(self, symbol, func, args, kwargs):
        """``jit(..., specialize_data=True)``: a Python value read from tensor data (``.item()``,
        ``bool(t)``) is computed now from the real inputs; the prologue recomputes it on every
        call. An int whose value changes between compilations (a position in a KV cache) becomes
        a size symbol (``Symbols.data_input``): the program's decisions on it are guards, checked
        like those on sizes, and its slices are symbolic; any other value is compiled in as a
        constant and checked to be the same (else: recompile)."""
        tensor = args[0]
        target = self._ctx.proxy(tensor)
        lines = self._slice(target.name)
        if any(b.tags & {MUTATION, RANDOM, OPAQUE} for b in lines) or self._written_before(
                target, lines):
            raise CaptureError(
                f"keraunos cannot specialize on `{symbol.name}` at {user_source()}: the value "
                f"depends on random or in-place ops, which the prologue cannot rerun.")
        source = user_source()
        reuse = self._symbols_by_read.get(_read_key(lines, target, symbol.name))
        if reuse is not None:  # the same value read again (each layer reads the position)
            return reuse
        value = self._data_value(target, lines, func, args, kwargs)
        symbolic = self._data_symbol(value, target, symbol.name, lines, source)
        if symbolic is not None:
            self._symbols_by_read[_read_key(lines, target, symbol.name)] = symbolic
            return symbolic
        self._ctx.guards.append(Guard(guards.DATA, None, value,
                                      expression=f"{target.name}.{symbol.name}()",
                                      read=DataRead(lines, target, symbol.name, source)))
        return value

    def _data_value(self, target, lines, func, args, kwargs):
        """The value the real inputs give, computed with the recorded ``lines`` (sizes at their
        values in this call: the prologue reads the same symbols before it computes them)."""
        from ..torch_internals.fake import unset_fake_temporarily

        def real(x):
            if isinstance(x, TensorProxy):
                return env[x.name]
            if type(x) is slice:  # pytree keeps slices whole: x[:n] with n a size symbol
                return slice(real(x.start), real(x.stop), real(x.step))
            if isinstance(x, Code):
                if not isinstance(getattr(x, "value", None), SYMBOLIC_TYPES):
                    raise SymbolicUnsupported("a value read from tensor data depends on a "
                                              "value the prologue cannot compute")
                return size_hint(x.value)
            return x
        env = {e.proxy.name: e.real for e in self._ctx.inputs}
        with unset_fake_temporarily(), DisableTorchFunction():
            for b in lines:
                fn_args, fn_kwargs = pytree.tree_map(real, (b.args, b.kwargs))
                out = b.symbol.fn(*fn_args, **fn_kwargs)
                for p, v in zip(pytree.tree_leaves(b.outputs), pytree.tree_leaves(out)):
                    if isinstance(p, TensorProxy):
                        env[p.name] = v
            return func(env[target.name], *args[1:], **kwargs)

    def _data_symbol(self, value, target, method: str, lines, source):
        """The ``SymInt`` the program gets for an int read from tensor data, or ``None`` when the
        value stays a constant (not an int, not asked to vary, or 0 or 1)."""
        dynamic = self._ctx.dynamic
        if dynamic is None or type(value) is not int:
            return None
        place = (source.filename, source.lineno) if source is not None else None
        key = ("data read", place, method, self._places.count(place))
        where = data_read_description(method, source)
        if not dynamic.data_is_dynamic(value, key, where):
            return None
        symint, proxy = self._ctx.symbols.data_input(value, target, method, lines, source)
        if proxy is None:
            return None
        self._places.append(place)
        return symint

    def _written_before(self, target, lines) -> bool:
        """Whether the program wrote, before this read, to memory the value is computed from:
        the prologue computes it from the inputs as they were passed (a write through another
        view of the same memory is not among ``lines``)."""
        read = {p.name for b in lines for p in b.input_proxies()} | {target.name}
        storage_of, mutated = self._ctx.storage_of, self._ctx.mutated_storages
        return any(storage_of.get(name) in mutated for name in read)

    def _slice(self, name: str) -> list[BoundSymbol]:
        """The recorded lines that compute ``name`` from the inputs, in order."""
        needed, lines = {name}, []
        for b in reversed(self._ctx.bound_symbols):
            if any(p.name in needed for p in b.output_proxies()):
                lines.append(b)
                needed.update(p.name for p in b.input_proxies())
        return list(reversed(lines))


def _read_key(lines, target, method: str) -> tuple:
    """What a read from tensor data computes, without the names of this capture: two reads
    with one key compute the same value from the same inputs (each layer of a model reading
    ``input_pos.max().item()``)."""
    made: dict[str, int] = {}

    def canonical(x):
        if isinstance(x, TensorProxy):
            return ("line", made[x.name]) if x.name in made else ("input", x.name)
        return repr(x)
    key = []
    for i, b in enumerate(lines):
        function = getattr(b.symbol, "fn", b.symbol)  # symbols are made per call site
        key.append((id(function), repr(pytree.tree_map(canonical, (b.args, b.kwargs)))))
        for p in b.output_proxies():
            made[p.name] = i
    return tuple(key), canonical(target), method
