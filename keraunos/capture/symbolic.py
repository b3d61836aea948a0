"""Symbolic sizes: one cache entry for many sizes of the dimensions that vary.

Which dimensions (and which Python ints of the call) are symbolic is decided per compilation by a
``DynamicRequest``: all of them in ``cache="symbolic values"``; in the default mode, those the
user marked (``keraunos.mark_dynamic``) and those whose value changed since an earlier
compilation (automatic dynamic, as ``torch.compile`` does). Everything else stays a constant.

A symbolic dimension is a symbol of PyTorch's ``ShapeEnv``: the fake tensor of that input has a
``SymInt`` size, Python arithmetic on it stays symbolic, and every decision the program (or a
meta kernel) takes on it is recorded by the ``ShapeEnv`` as a guard. ``Symbols`` gives each
symbol a name in the traces (``s0``, ``s1``, ...), the place it is read from on every call
(``x.shape[1]``, an int argument), and turns the ``ShapeEnv``'s facts into the prologue's checks:
replacements (``s1 == 64``), divisibility (``s0 % 8 == 0``), ranges (``2 <= s0``) and the
remaining guards, each simplified and dropped when the others imply it.

Sizes 0 and 1 are never symbolic (the ``ShapeEnv`` specializes them, as in ``torch.compile``): a
size-1 dimension broadcasts and a size-0 one makes a tensor empty, so the program captured for a
general size would be wrong for them, and guarding ``s0 != 1`` on every broadcast would fill the
prologue. A symbol's range starts at 2; a call with 0 or 1 there compiles an entry of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..torch_internals.fake import DimDynamic, StatelessSymbolicContext, int_oo
from ..core.proxies import NumberProxy
from ..core.provenance import Path
from ..core.symbolic import SymbolicUnsupported, SymbolicValue, SizePrinter, as_code
from ..integrations import huggingface
from .interceptors import paused_watch


def mark_dynamic(t: torch.Tensor, dim: int | list[int]) -> None:
    """Compile dimension ``dim`` of ``t`` with a symbolic size from the first call on.

    >>> import torch, keraunos
    >>> x = torch.randn(4, 16)
    >>> keraunos.mark_dynamic(x, 1)
    """
    dims = [dim] if isinstance(dim, int) else list(dim)
    t._keraunos_dynamic = set(getattr(t, "_keraunos_dynamic", ())) | {d % t.dim() for d in dims}


def mark_static(t: torch.Tensor, dim: int | list[int]) -> None:
    """Never make dimension ``dim`` of ``t`` symbolic (each size compiles its own entry)."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    t._keraunos_static = set(getattr(t, "_keraunos_static", ())) | {d % t.dim() for d in dims}


# The hyperparameters of ``optimizer.param_groups`` an LR scheduler changes on its steps (SGD's
# momentum: OneCycleLR and CyclicLR cycle it).
HYPERPARAMETERS = ("lr", "momentum")


def is_hyperparameter(path: Path) -> bool:
    """Whether ``path`` is ``<...>.param_groups[i][key]`` for a key in ``HYPERPARAMETERS``."""
    group = path.parent
    return path.is_item and path.key in HYPERPARAMETERS and group is not None and \
        group.is_item and group.parent is not None and group.parent.is_attr and \
        group.parent.key == "param_groups"


def _from_call(path: Path) -> bool:
    """Whether the path starts at the call's arguments (not the module, globals or closure)."""
    return path.origin.key in ("args", "kwargs")


@dataclass
class DynamicRequest:
    """Which sizes and ints one compilation makes symbolic.

    ``seen`` is the jitted callable's memory: for each tensor path, the sizes of earlier
    compilations (``None`` for a dimension already symbolic), for each int path, its value in a
    1-tuple. ``changes`` collects the sentences a miss reason shows; ``updated`` is the memory
    after this compilation, kept by ``jit`` once it succeeds."""

    all_arguments: bool
    seen: dict
    changes: list[str] = field(default_factory=list)
    updated: dict = field(default_factory=dict)
    any_dynamic: bool = False
    # Set when the call comes from Hugging Face generate(): what it varies is symbolic from the
    # first call on, as if marked dynamic, so that a later prompt length compiles nothing
    # (``integrations/huggingface.py``).
    generating: bool = False

    def __post_init__(self):
        # Created on a cache miss only: the stack walk costs nothing on the hit path.
        self.generating = huggingface.called_from_generate()

    def _generate_dims(self, path: Path, ndim: int) -> set[int]:
        return huggingface.varying_dims(path, ndim) if self.generating else set()

    def tensor_dims(self, real: torch.Tensor, path: Path) -> list[bool]:
        n = real.dim()
        if not _from_call(path):
            return [False] * n
        marked = set(getattr(real, "_keraunos_dynamic", ())) | set(
            getattr(real, "_dynamo_dynamic_indices", ())) | self._generate_dims(path, n)
        static = set(getattr(real, "_keraunos_static", ()))
        before = self.seen.get(path)
        shape = tuple(real.shape)
        dynamic = []
        for d in range(n):
            changed = before is not None and len(before) == n and (
                before[d] is None or before[d] != shape[d])
            if changed and before[d] is not None and d not in static and shape[d] > 1:
                self.changes.append(f"{path} dimension {d} changed {before[d]} → {shape[d]}")
            dynamic.append(d not in static and (self.all_arguments or d in marked or changed))
        self.updated[path] = tuple(None if dyn else s for dyn, s in zip(dynamic, shape))
        # A size of 0 or 1 is specialized (see the module docstring): not a symbol.
        if any(dyn and s > 1 for dyn, s in zip(dynamic, shape)):
            self.any_dynamic = True
        return dynamic

    def data_is_dynamic(self, value: int, key: tuple, where: str) -> bool:
        """Whether an int read from tensor data (``specialize_data=True``) is a symbol: in
        ``cache="symbolic values"`` always, otherwise once its value changed between compilations
        (automatic dynamic, as for int arguments). ``key`` names the read across compilations:
        its line and its place among the distinct reads on that line."""
        before = self.seen.get(key)
        changed = before is not None and (before[0] is None or before[0] != value)
        if changed and before[0] is not None and value not in (0, 1):
            self.changes.append(f"{where} changed {before[0]} → {value}")
        dynamic = self.all_arguments or changed
        self.updated[key] = (None if dynamic else value,)
        if dynamic and value not in (0, 1):
            self.any_dynamic = True
        return dynamic

    def int_is_dynamic(self, value: int, path: Path) -> bool:
        if not _from_call(path) or path.is_root:
            return False
        return self._number_is_dynamic(value, path)

    def float_is_dynamic(self, value: float, path: Path) -> bool:
        """Whether a float the program reads is a symbol: an optimizer's hyperparameter (a
        learning rate an LR scheduler changes), once its value changed between compilations."""
        if not is_hyperparameter(path):
            return False
        return self._number_is_dynamic(value, path)

    def _number_is_dynamic(self, value, path: Path) -> bool:
        before = self.seen.get(path)
        changed = before is not None and (before[0] is None or before[0] != value)
        if changed and before[0] is not None and value not in (0, 1):
            self.changes.append(f"{path} changed {before[0]} → {value}")
        generated = self.generating and huggingface.varies_int(path)
        dynamic = self.all_arguments or changed or generated
        self.updated[path] = (None if dynamic else value,)
        if dynamic and value not in (0, 1):
            self.any_dynamic = True
        return dynamic


@dataclass
class Binding:
    """Where a symbol is read from on every call: ``x.shape[d]``, ``x.stride(d)``,
    ``x.storage_offset()`` of a tensor input (``tensor`` its proxy), an int input itself, or an
    int read from tensor data (``prop`` "data": ``tensor`` is the tensor it is read from, computed
    from the inputs by ``lines``, and ``method`` the read, ``item``)."""

    proxy: NumberProxy
    path: Path | None
    tensor: Any = None
    prop: str | None = None  # "size", "stride", "storage_offset", "data"; None for an int input
    dim: int | None = None
    lines: tuple = ()
    method: str | None = None
    source: Any = None  # the user's line of a data read

    def read(self) -> str:
        t = self.tensor.name if self.tensor is not None else None
        if self.prop == "data":
            return f"{t}.{self.method}()"
        if self.prop == "size":
            return f"{t}.shape[{self.dim}]"
        if self.prop == "stride":
            return f"{t}.stride({self.dim})"
        if self.prop == "storage_offset":
            return f"{t}.storage_offset()"
        return str(self.path)

    def where(self) -> str:
        if self.prop == "data":
            return data_read_description(self.method, self.source)
        if self.prop == "size":
            return f"{self.path}.shape[{self.dim}]"
        if self.prop == "stride":
            return f"{self.path}.stride({self.dim})"
        if self.prop == "storage_offset":
            return f"{self.path}.storage_offset()"
        return str(self.path)


def data_read_description(method: str, source) -> str:
    """A value read from tensor data, in the user's words: where the program reads it."""
    if source is None:
        return f"the value of .{method}()"
    return f"the value of .{method}() at {source.filename}:{source.lineno} ({source.code})"


def _non_view_alias(real: torch.Tensor, path: Path) -> torch.Tensor:
    """A tensor on ``real``'s memory, with its sizes, strides and offset, that is no view.

    A view's fake would be a view of a fake of its base, whose sizes get symbols of their own that
    nothing binds (the base is no input); the program only sees the view's own layout (and its
    storage, which the fake mode still shares with every other input on it, so that writes to
    shared memory are refused as for any input: capture/program.py). Views that require grad
    keep exact sizes: their gradient must flow to the base through the view's autograd history.
    So do views with the conjugate or negative bit (``x.conj()``): ``set_`` would drop the bit,
    and the program would see (and bake in) ``is_conj() == False``."""
    if real.requires_grad:
        raise SymbolicUnsupported(f"{path} is a view that requires grad; it keeps exact sizes")
    if real.is_conj() or real.is_neg() or real._is_zerotensor():
        raise SymbolicUnsupported(f"{path} is a view with the conjugate, negative or zero bit; "
                                  f"it keeps exact sizes")
    from ..torch_internals.fake import unset_fake_temporarily
    with unset_fake_temporarily(), torch.no_grad():
        alias = torch.empty(0, dtype=real.dtype, device=real.device)
        return alias.set_(real.untyped_storage(), real.storage_offset(), real.shape,
                          real.stride())


class Symbols:
    """The size symbols of one capture: their names, bindings and the prologue's checks."""

    def __init__(self, fake_mode, names):
        # Imported before the capture watches Python calls (its first import runs importers).
        from ..torch_internals.dynamo import ConstantSource  # noqa: F401
        self.fake_mode = fake_mode
        self.env = fake_mode.shape_env
        self.names = names
        self.bindings: dict[sympy.Symbol, Binding] = {}
        self._printer = SizePrinter({})
        # Trace comments print shapes in these names too (TensorProxy.describe).
        self.env.keraunos_names = self._printer.names

    # ------------------------------------------------------------------------- inputs
    def tensor_fake(self, real: torch.Tensor, path: Path, dynamic: list[bool]):
        """A fake of ``real`` whose ``dynamic`` dimensions are symbols."""
        from ..torch_internals.dynamo import ConstantSource  # already imported by fake tensors
        if real.is_sparse:
            raise SymbolicUnsupported(f"{path} is sparse")
        if real._base is not None:
            real = _non_view_alias(real, path)
        context = StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])
        with paused_watch():
            return self.fake_mode.from_tensor(real, static_shapes=False,
                                              source=ConstantSource(str(path)),
                                              symbolic_context=context)

    def bind_tensor(self, fake, proxy, path: Path) -> None:
        """Name the symbols of a tensor input's sizes, strides and offset, where each is read."""
        places = [("size", d, s) for d, s in enumerate(fake.shape)]
        places += [("stride", d, s) for d, s in enumerate(fake.stride())]
        places.append(("storage_offset", None, fake.storage_offset()))
        for prop, dim, value in places:
            if isinstance(value, torch.SymInt):
                expr = value.node._expr  # as created: the symbol itself, before replacements
                if isinstance(expr, sympy.Symbol) and expr not in self.bindings:
                    self._bind(expr, value, path, proxy, prop, dim)

    def int_input(self, value: int, path: Path):
        """A symbolic int for an int argument; its proxy is the prologue's variable for it."""
        from ..torch_internals.dynamo import ConstantSource
        with paused_watch():
            expr = self.env.create_symbol(value, ConstantSource(str(path)), DimDynamic.DYNAMIC,
                                          positive=None)
        if not isinstance(expr, sympy.Symbol):  # 0 and 1 are specialized
            return value, None
        symint = self.env.create_symintnode(expr, hint=value)
        return symint, self._bind(expr, symint, path, None, None, None)

    def float_input(self, value: float, path: Path):
        """A symbolic float for an optimizer's hyperparameter (``float_is_dynamic``); its
        proxy is the prologue's variable for it."""
        from ..torch_internals.dynamo import ConstantSource
        with paused_watch():  # the ShapeEnv's first symbol imports modules: not the program's
            expr = self.env.create_unspecified_symbol(value, ConstantSource(str(path)),
                                                      DimDynamic.DYNAMIC)
        symfloat = self.env.create_symfloatnode(expr, hint=value)
        return symfloat, self._bind(expr, symfloat, path, None, None, None, float)

    def data_input(self, value: int, target, method: str, lines, source):
        """A symbolic int for an int the program reads from tensor data: the prologue computes
        ``target`` from the inputs with ``lines`` and reads it (``t3.item()``) on every call,
        then checks the guards on it like those on sizes. ``(value, None)`` for 0 and 1, which
        are specialized as sizes are."""
        from ..torch_internals.dynamo import ConstantSource
        name = f"data read {len(self.bindings)}"
        expr = self.env.create_symbol(value, ConstantSource(name), DimDynamic.DYNAMIC,
                                      positive=None)
        if not isinstance(expr, sympy.Symbol):
            return value, None
        symint = self.env.create_symintnode(expr, hint=value)
        proxy = self._bind(expr, symint, None, target, "data", None)
        binding = self.bindings[expr]
        binding.lines, binding.method, binding.source = tuple(lines), method, source
        proxy.provenance = binding.where()
        return symint, proxy

    @property
    def data_bindings(self) -> list[Binding]:
        return [b for b in self.bindings.values() if b.prop == "data"]

    def _bind(self, expr, value, path, tensor, prop, dim, python_type=int) -> NumberProxy:
        proxy = NumberProxy(self.names.fresh(f"s{len(self.bindings)}"), python_type, value, expr)
        self.bindings[expr] = Binding(proxy, path, tensor, prop, dim)
        proxy.provenance = self.bindings[expr].where()
        self._printer.names[expr] = proxy.name
        return proxy

    @property
    def proxies(self) -> list[NumberProxy]:
        return [b.proxy for b in self.bindings.values()]

    # ---------------------------------------------------------------------- expressions
    def code(self, value) -> SymbolicValue | Any:
        """A ``SymInt`` (``SymFloat``, ``SymBool``) as a trace value; plain values unchanged."""
        return as_code(value, {s: b.proxy for s, b in self.bindings.items()})

    def print(self, expr) -> str:
        return self._printer.doprint(expr)

    # ----------------------------------------------------------------------------- guards
    def checks(self) -> list[tuple[str, str]]:
        """(Python condition that must hold, readable description) for everything the capture
        assumed about the symbols, read from the ``ShapeEnv`` when asked: the prologue asks
        when it is generated, after the backward was recorded on the same symbols."""
        env = self.env
        out: list[tuple[str, str]] = []
        seen: set[str] = set()

        def add(expr, why: str = ""):
            text = self.print(expr)
            if text not in seen:
                seen.add(text)
                out.append((text, why))
        for sym, b in self.bindings.items():
            target = env.replacements.get(sym)
            if target is not None:
                add(sympy.Eq(sym, env.replace(target)), f"{b.proxy.name} is {b.where()}")
        for expr in sorted(env.divisible, key=str):
            if not expr.free_symbols <= set(self.bindings):
                continue
            add(sympy.Eq(expr, 0))
        for sym, b in self.bindings.items():
            if sym in env.replacements and env.replace(sym).is_number:
                continue
            r = env.var_to_range.get(sym)
            if r is None:
                continue
            if r.lower.is_number and r.lower not in (-int_oo, -sympy.oo):
                add(sympy.Le(int(r.lower), sym, evaluate=False), f"{b.proxy.name} is {b.where()}")
            if r.upper.is_number and r.upper not in (int_oo, sympy.oo):
                add(sympy.Le(sym, int(r.upper), evaluate=False), f"{b.proxy.name} is {b.where()}")
        for guard in env.guards:
            expr = env.simplify(guard.expr)
            # Implied by the replacements, divisibility and ranges checked above? Asked without
            # axioms: by default the ShapeEnv assumes its own guards, so every guard would look
            # implied (an `if n % 2 == 0` lost its guard; fuzzer 20:1792).
            if expr == sympy.true or env._maybe_evaluate_static(expr, axioms=()) == sympy.true:
                continue
            if not expr.free_symbols <= set(self.bindings):
                raise SymbolicUnsupported(f"a guard on data-dependent sizes: {expr}")
            add(expr)
        return out


