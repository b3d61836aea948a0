"""The prologue: unpack the computation's inputs from what the user passed, and check every guard.

``def prologue(*args, **kwargs)`` returns ``(inputs, pro_to_epi)`` when the cached program is valid
for the call, or the index of the first failing check (an ``int``; a ``str`` with details when
the batched tensor check fails). It never raises for a mismatch: a failed check only means "not
this cache entry". The module, the function's globals and closure are names in its namespace.
"""
from __future__ import annotations

import copy
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..core.proxies import ObjectProxy, Proxy, TensorProxy
from ..core.symbols import BoundSymbol, Code, GlueSymbol
from ..core.tags import MODULE_CHECK
from ..core.trace import Trace
from .guards import Guard
from .provenance import Path
from .symbolic import has_symbols


@dataclass
class MutableGroup:
    """Inputs sharing one storage that the program writes to; ``base`` is what the computation
    receives (the input itself, or a flat view of the whole storage), ``updated`` its new value."""

    base: TensorProxy
    updated: TensorProxy
    members: list
    whole_storage: bool
    with_grad: bool = True  # whether the program wrote with grad mode on
    # (shape, stride, offset change, resized) when the program changed the input's metadata in place
    # (t_(), squeeze_(), resize_()): the epilogue gives the input its new metadata first.
    new_metadata: tuple | None = None


def check_tensor(t, shape, stride, dtype, device, requires_grad) -> bool:
    """The metadata check of one tensor, as the readable prologue writes it."""
    return (isinstance(t, torch.Tensor) and t.shape == shape and t.stride() == stride
            and t.dtype is dtype and t.device == device and t.requires_grad is requires_grad)


def _unpack_formatter(bsym, w):
    (parent,), path = bsym.args, bsym.info["path"]
    return [f"{bsym.outputs.name} = {path.expression(parent)}"]


def storage_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat view of all of ``t``'s storage. Taken of the tensor ``t`` views (when it views one
    with its dtype and requires_grad) so that gradients reach memory outside ``t`` itself (the
    rows of another argument sharing the storage), as they do in eager."""
    base = t._base
    if base is None or base.dtype is not t.dtype or base.requires_grad is not t.requires_grad:
        base = t
    return torch.as_strided(base, (numel,), (1,), 0)


def _storage_view_formatter(bsym, w):
    (tensor,), n = bsym.args, bsym.info["numel"]
    return [f"{bsym.outputs.name} = storage_view({tensor.name}, {n})"]


def _check_formatter(bsym, w):
    return [f"if {bsym.info['condition'](w)}: return {bsym.info['index']}  "
            f"# {bsym.info['description']}"]


def _check_tensor_formatter(bsym, w):
    (t,), e = bsym.args, bsym.info["expected"]
    return [f"if not check_tensor({t.name}, {w.value(e['shape'])}, {w.value(e['stride'])}, "
            f"{w.value(e['dtype'])}, {w.value(e['device'])}, {e['requires_grad']}): "
            f"return {bsym.info['index']}"]


def _return_formatter(bsym, w):
    inputs, pro_to_epi = bsym.args
    return [f"return {w.value(tuple(inputs))}, {w.value(tuple(pro_to_epi))}"]


UNPACK = GlueSymbol("unpack", _unpack_formatter)
UNPACK_CONSTANT = GlueSymbol("unpack_constant",
                             lambda b, w: [f"{b.outputs.name} = {b.args[0]}"])
STORAGE_VIEW = GlueSymbol("storage_view", _storage_view_formatter,
                          {"storage_view": storage_view})
CHECK = GlueSymbol("check", _check_formatter)
CHECK_TENSOR = GlueSymbol("check_tensor", _check_tensor_formatter, {"check_tensor": check_tensor})
RETURN = GlueSymbol("return", _return_formatter)


class _Builder:
    def __init__(self, ctx, check_values: bool):
        self.ctx = ctx
        self.check_values = check_values
        self.bsyms: list[BoundSymbol] = []
        self.vars: dict[Path, Proxy] = {}
        self.descriptions: list[str] = []
        self.namespace: dict[str, Any] = {}
        fn = ctx.fn
        self.roots = {"args": "args", "kwargs": "kwargs", "module": "module",
                      "globals": "fn_globals", "closure": "fn_closure"}
        self.namespace["fn_globals"] = getattr(fn, "__globals__", None)
        self.namespace["fn_closure"] = getattr(fn, "__closure__", None)

    def var(self, path: Path, proxy: Proxy | None = None) -> str:
        known = self.vars.get(path)
        if known is not None:
            return known.name
        if path.kind == "root":
            if path.key in self.roots:
                return self.roots[path.key]
            name = f"_captured{len(self.namespace)}"
            self.namespace[name] = self.ctx.root_objects[path.key]
            if proxy is not None:  # a tensor the program holds by reference
                self.vars[path] = proxy
                self.bsyms.append(BoundSymbol(UNPACK_CONSTANT, (name,), outputs=proxy,
                                              info={"path": path}))
                return proxy.name
            return name
        parent = self.var(path.parent)
        if proxy is None:
            proxy = ObjectProxy(self.ctx.names.fresh(path.name_hint()), object, provenance=str(path))
        self.vars[path] = proxy
        self.bsyms.append(BoundSymbol(UNPACK, (parent,), outputs=proxy, info={"path": path}))
        return proxy.name

    def check(self, description: str, condition, from_module: bool, guard: Guard | None = None,
              subject: Path | None = None, uses: tuple = ()) -> None:
        index = len(self.descriptions)
        self.descriptions.append(description)
        tags = {MODULE_CHECK} if from_module else set()
        # ``uses``: the variables the condition reads (strings), for passes that move lines.
        self.bsyms.append(BoundSymbol(CHECK, args=tuple(uses), tags=tags, info={
            "condition": condition, "index": index, "description": description, "guard": guard,
            "subject": subject}))

    def guard(self, g: Guard) -> None:
        if g.kind == "data":
            return  # after the tensors are extracted: see data_guard
        if g.kind == "global":
            expected = g.expected
            self.check(g.description, lambda w: f"{g.expression} is not {w.value(expected)}"
                       if isinstance(expected, (bool, torch.dtype)) or expected is None
                       else f"{g.expression} != {w.value(expected)}", False)
            return
        if g.kind == "absent attribute":  # of a plain object passed in
            parent = self.var(g.path.parent)
            name = g.path.key
            self.check(g.description, lambda w: f"{name!r} in {parent}.__dict__", False, guard=g,
                       uses=(parent,))
            return
        if g.kind == "absent":
            parent = self.var(g.path.parent)
            name = g.path.key
            self.check(g.description, lambda w: " or ".join(
                f"{name!r} in {parent}.{table}"
                for table in ("__dict__", "_parameters", "_buffers", "_modules")),
                g.from_module, guard=g, subject=g.path, uses=(parent,))
            return
        if g.kind == "symbolic int":  # the int is the symbol: s0 = args[1]
            v = self.var(g.path, g.expected)
            self.check(g.description, lambda w: f"type({v}) is not int", False, uses=(v,))
            return
        v = self.var(g.path)
        check = functools.partial(self.check, guard=g, subject=g.path, uses=(v,))
        if g.kind == "value":
            check(g.description, lambda w: _value_condition(v, g.expected, w), g.from_module)
        elif g.kind == "identity":
            other = g.expected
            if hasattr(other, "proxy") and hasattr(other, "fake"):  # another tensor input
                first = self.var(other.path, other.proxy)
                self.check(g.description, lambda w: f"{v} is not {first}", g.from_module, guard=g,
                           subject=g.path, uses=(v, first))
                self.bsyms[-1].info["paths"] = (g.path, other.path)
            else:
                check(g.description, lambda w: f"{v} is not {w.constant(other, 'obj')}",
                           g.from_module)
        elif g.kind == "type":
            cls = g.expected
            check(g.description, lambda w: f"type({v}) is not {w.constant(cls, cls.__name__)}",
                       g.from_module)
        elif g.kind == "length":
            python_type, n = g.expected
            if g.path.kind == "root":
                check(g.description, lambda w: f"len({v}) != {n}", False)
            else:
                check(g.description, lambda w: f"type({v}) is not "
                           f"{w.constant(python_type, python_type.__name__)} or len({v}) != {n}",
                           g.from_module)
        elif g.kind == "keys":
            _, keys = g.expected
            if g.path.kind == "root" and not keys:
                check(g.description, lambda w: f"{v}", False)
            elif g.path.kind == "root" or g.path.key in ("_modules", "_parameters", "_buffers"):
                check(g.description, lambda w: f"list({v}) != {w.value(list(keys))}",
                      g.from_module)
            else:
                check(g.description, lambda w: f"type({v}) is not dict or list({v}) != "
                      f"{w.value(list(keys))}", g.from_module)
        else:
            raise AssertionError(g.kind)


def _bind_formatter(bsym, w):
    return [f"{bsym.outputs.name} = {bsym.info['read']}  # {bsym.info['where']}"]


def _symbolic_tensor_formatter(bsym, w):
    # The rest was checked in one C++ call (symbolic_tensor_guards): here only the sizes and
    # strides that are expressions of the symbols, leaving out the dimensions read into their
    # own symbols (s0 = x.shape[0]).
    (t,), e = bsym.args, bsym.info["expected"]
    name, bound = t.name, bsym.info["bound_dims"]
    parts = [f"{name}.shape[{d}] == {w.value(size)}" for d, size in enumerate(e["shape"])
             if d not in bound and not isinstance(size, int)]
    if not all(isinstance(stride, int) for stride in e["stride"]):  # one call: cheaper than two
        parts.append(f"{name}.stride() == {w.value(e['stride'])}")
    if not parts:
        return [f"pass  # {name}: its sizes are its symbols, its strides numbers"]
    return [f"if not ({' and '.join(parts)}): return {bsym.info['index']}"]


def _size_checks_formatter(bsym, w):
    # Read from the ShapeEnv now, when the prologue is generated: after the capture, the
    # backward's recording on the same symbols may have added guards.
    lines = []
    for condition, why in bsym.info["symbols"].checks():
        text = f"{condition} ({why})" if why else condition
        lines.append(f"if not ({condition}): return {text!r}")
    return lines or ["pass  # no guards on the symbolic sizes"]


BIND = GlueSymbol("bind_symbol", _bind_formatter)
CHECK_SYMBOLIC_TENSOR = GlueSymbol("check_symbolic_tensor", _symbolic_tensor_formatter)
CHECK_SIZES = GlueSymbol("check_sizes", _size_checks_formatter)


def bind_symbols(b: _Builder, ctx, check_values: bool) -> None:
    """Read each size symbol from where it lives (``s0 = x.shape[1]``) after one C++ call has
    checked each such tensor's type and rank (``symbolic_tensor_guards``), then check the guards
    on the symbols."""
    by_tensor: dict[str, list] = {}
    for binding in ctx.symbols.bindings.values():
        if binding.tensor is not None:
            by_tensor.setdefault(binding.tensor.name, []).append(binding)
        else:  # an int argument: its variable is the symbol (checked to be an int with guards)
            b.var(binding.path, binding.proxy)
    symbolic = [entry for entry in ctx.inputs if has_symbols(entry.fake)]
    if symbolic:
        symbolic_tensor_guards(b, symbolic)
    for entry in ctx.inputs:
        bindings = by_tensor.get(entry.proxy.name)
        if not bindings:
            continue
        for binding in bindings:
            b.bsyms.append(BoundSymbol(BIND, (entry.proxy,), outputs=binding.proxy, info={
                "read": binding.read(), "where": binding.where()}))
    if check_values:
        b.bsyms.append(BoundSymbol(CHECK_SIZES, tuple(p.name for p in ctx.symbols.proxies),
                                   info={"symbols": ctx.symbols}))


def symbolic_tensor_guards(b: _Builder, entries) -> None:
    """One C++ call (dynamo's ``TensorGuards``) checking each tensor with symbolic sizes for its
    type, rank, dtype, device, requires_grad, dispatch keys, and the sizes and strides compiled
    as numbers; what is symbolic is checked against the symbols after they are bound."""
    from torch._C._dynamo.guards import TensorGuards

    def plain(values):
        return [None if isinstance(v, torch.SymInt) else v for v in values]
    guards = TensorGuards(*(e.real for e in entries),
                          dynamic_dims_sizes=[plain(e.fake.shape) for e in entries],
                          dynamic_dims_strides=[plain(e.fake.stride()) for e in entries])
    names = tuple(e.proxy.name for e in entries)
    described = "; ".join(f"{e.path}: {e.real.dim()} dimensions, {e.real.dtype}, "
                          f"{e.real.device}, requires_grad {e.real.requires_grad}" for e in entries)
    b.check(f"{described} (and dispatch keys, and the sizes compiled as numbers)",
            lambda w: f"not {w.constant(guards, 'tensor_guards')}.check({', '.join(names)})",
            False, uses=names)


def check_symbolic_tensor(b: _Builder, ctx, entry) -> None:
    """The metadata check of a tensor with symbolic sizes: its shape and strides as expressions
    of the symbols (``(1, s0, 64)``, ``(64*s0, 64, 1)``)."""
    fake, code = entry.fake, ctx.symbols.code
    expected = {"shape": tuple(map(code, fake.shape)), "stride": tuple(map(code, fake.stride())),
                "dtype": entry.real.dtype, "device": entry.real.device,
                "requires_grad": entry.real.requires_grad}
    index = len(b.descriptions)
    b.descriptions.append(f"tensor {entry.path} has shape {_show(expected['shape'])} and stride "
                          f"{_show(expected['stride'])} (its dtype, device and requires_grad are "
                          f"checked with the other tensors' in one call)")
    bound = {binding.dim for binding in ctx.symbols.bindings.values()
             if binding.tensor is entry.proxy and binding.prop == "size"}
    b.bsyms.append(BoundSymbol(CHECK_SYMBOLIC_TENSOR, (entry.proxy,), info={
        "expected": expected, "index": index, "bound_dims": bound}))


def _show(values: tuple) -> str:
    return "(" + ", ".join(map(str, values)) + ("," if len(values) == 1 else "") + ")"


def data_guard(b: _Builder, g: Guard) -> None:
    """Recompute a value read from tensor data, with the ops that made it, and check it."""
    for line in g.lines:
        b.bsyms.append(line.replace(info={**line.info, "after_structure": True}))
    expected = g.expected
    b.check(g.description, lambda w: f"{g.target.name}.{g.method}() != {w.value(expected)}"
            if is_plain_value(expected) else
            f"{g.target.name}.{g.method}() != {w.constant(expected, 'expected')}", False,
            uses=(g.target.name,))
    b.bsyms[-1].info["after_structure"] = True


def is_plain_value(v) -> bool:
    return v is None or type(v) in (bool, int, float, str)


def _value_condition(v: str, expected: Any, w) -> str:
    if expected is None or type(expected) is bool:
        return f"{v} is not {expected!r}"
    if isinstance(expected, torch.dtype):
        return f"{v} is not {w.value(expected)}"
    if type(expected) is float and expected != expected:
        return f"type({v}) is not float or {v} == {v}"  # nan: the only value unequal to itself
    if type(expected) is float and expected == 0.0:
        # -0.0 == 0.0, but x * -0.0 is not x * 0.0: the sign must match too.
        sign = "<" if math.copysign(1.0, expected) > 0 else ">"
        return (f"type({v}) is not float or {v} != 0.0 or "
                f"{w.constant(math.copysign, 'copysign')}(1.0, {v}) {sign} 0.0")
    if type(expected) in (int, float, str):
        return f"type({v}) is not {type(expected).__name__} or {v} != {w.value(expected)}"
    # Containers and complex numbers: exact equality, with signed zeros and nans told apart.
    return (f"type({v}) is not {w.constant(type(expected), type(expected).__name__)} or not "
            f"{w.constant(same_value, 'same_value')}({v}, "
            f"{w.constant(copy.deepcopy(expected), 'expected')})")


def same_value(a, b) -> bool:
    """``a == b``, where ``-0.0`` differs from ``0.0`` and ``nan`` equals ``nan``, at any depth."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a.hex() == b.hex() or a != a and b != b
    if type(a) is complex:
        return same_value(a.real, b.real) and same_value(a.imag, b.imag)
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    return a == b


def build_prologue(ctx, params: list[TensorProxy], groups: list[MutableGroup],
                   pro_to_epi: list[Any], check_values: bool) -> tuple[Trace, list[str]]:
    b = _Builder(ctx, check_values)
    if check_values:
        for g in ctx.guards:
            b.guard(g)
    for entry in ctx.inputs:
        b.var(entry.path, entry.proxy)
    if ctx.symbols is not None:
        bind_symbols(b, ctx, check_values)
    if check_values:
        for g in ctx.guards:
            if g.kind == "data":
                data_guard(b, g)
    for g in groups:
        if g.whole_storage:
            first = g.members[0]
            n = first.real.untyped_storage().nbytes() // first.real.element_size()
            if check_values:
                # The computation rebuilds these inputs as views of one storage: they must share
                # it, at the offsets compiled for, and it must have the compiled size.
                names = [m.proxy.name for m in g.members]
                nbytes = first.real.untyped_storage().nbytes()
                offsets = [m.real.storage_offset() for m in g.members]

                def same_storage(w, names=names, nbytes=nbytes, offsets=offsets):
                    parts = [f"{names[0]}.untyped_storage().nbytes() != {nbytes}"]
                    parts += [f"{n}.untyped_storage().data_ptr() != "
                              f"{names[0]}.untyped_storage().data_ptr()" for n in names[1:]]
                    parts += [f"{n}.storage_offset() != {o}" for n, o in zip(names, offsets)]
                    return " or ".join(parts)
                b.check(f"{', '.join(str(m.path) for m in g.members)} share one storage of "
                        f"{nbytes} bytes at offsets {offsets}", same_storage, False,
                        uses=tuple(names))
                # A member may be a buffer, which the fast prologue loads with the module
                # structure: this check and the view must come after that.
                b.bsyms[-1].info["after_structure"] = True
            b.bsyms.append(BoundSymbol(STORAGE_VIEW, (first.proxy,), outputs=g.base,
                                       info={"numel": n, "after_structure": True}))
    if check_values:
        for entry in ctx.inputs:
            real = entry.real
            if ctx.symbols is not None and has_symbols(entry.fake):
                check_symbolic_tensor(b, ctx, entry)
                continue
            expected = {"shape": tuple(real.shape), "stride": tuple(real.stride()),
                        "dtype": real.dtype, "device": real.device,
                        "requires_grad": real.requires_grad}
            index = len(b.descriptions)
            b.descriptions.append(f"tensor {entry.path} has the shape, stride, dtype, device and "
                                  f"requires_grad it was compiled for")
            b.bsyms.append(BoundSymbol(CHECK_TENSOR, (entry.proxy,), tags=set(entry.proxy.tags),
                                       info={"expected": expected, "index": index,
                                             "real": weakref.ref(real),
                                             "path": str(entry.path)}))
    epi_values = []
    for x in pro_to_epi:
        epi_values.append(Code(b.var(x)) if isinstance(x, Path) else x)
    b.bsyms.append(BoundSymbol(RETURN, (list(params), epi_values)))
    trace = Trace("prologue", ["*args", "**kwargs"], b.bsyms, ["Constructed by capture"],
                  namespace={"module": getattr(ctx, "root_module", None), **b.namespace})
    return trace, b.descriptions
