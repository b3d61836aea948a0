"""The prologue: unpack the computation's inputs from what the user passed, and check every guard.

``def prologue(*args, **kwargs)`` returns ``(inputs, pro_to_epi)`` when the cached program is valid
for the call, or the index of the first failing check (an ``int``; a ``str`` with details when
the batched tensor check fails). It never raises for a mismatch: a failed check only means "not
this cache entry". The module, the function's globals and closure are names in its namespace.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..torch_internals.dispatch import dispatch_keys
from ..core import glue
from ..core.proxies import ObjectProxy, Proxy, TensorProxy
from ..core.symbols import BoundSymbol
from ..core.tags import AFTER_STRUCTURE, MODULE_CHECK
from ..core.trace import Trace
from .guards import Guard
from ..core.provenance import Path
from ..core.symbolic import has_symbols


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


class _Builder:
    """The prologue as it is written. Each guard's kind writes its checks through ``var``,
    ``check`` and ``number`` (``capture/guards.py``)."""

    def __init__(self, ctx, check_values: bool):
        self.ctx = ctx
        self.check_values = check_values
        self.bsyms: list[BoundSymbol] = []
        self.vars: dict[Path, Proxy] = {}
        self.descriptions: list[str] = []
        self.namespace: dict[str, Any] = {}
        fn = ctx.fn
        # The roots every path starts from: the prologue's parameters and namespace names.
        self.roots = {key: ObjectProxy(name, object, provenance=key) for key, name in (
            ("args", "args"), ("kwargs", "kwargs"), ("module", "module"),
            ("globals", "fn_globals"), ("closure", "fn_closure"))}
        self.namespace["fn_globals"] = getattr(fn, "__globals__", None)
        self.namespace["fn_closure"] = getattr(fn, "__closure__", None)

    def var(self, path: Path, proxy: Proxy | None = None) -> Proxy:
        """The variable holding the value at ``path``, unpacked from its parent on first use."""
        known = self.vars.get(path)
        if known is not None:
            return known
        if path.is_root:
            if path.key in self.roots:
                return self.roots[path.key]
            name = f"_captured{len(self.namespace)}"
            self.namespace[name] = self.ctx.root_objects[path.key]
            if proxy is not None:  # a tensor the program holds by reference
                self.vars[path] = proxy
                self.bsyms.append(glue.UNPACK_CONSTANT.bind(outputs=proxy, path=path,
                                                            constant=name))
                return proxy
            self.vars[path] = ObjectProxy(name, object, provenance=str(path))  # a namespace name
            return self.vars[path]
        parent = self.var(path.parent)
        if proxy is None:
            proxy = ObjectProxy(self.ctx.names.fresh(path.name_hint()), object, provenance=str(path))
        self.vars[path] = proxy
        self.bsyms.append(glue.UNPACK.bind(parent, outputs=proxy, path=path))
        return proxy

    def number(self, description: str) -> int:
        """The index of a new check: what the prologue returns when it fails."""
        self.descriptions.append(description)
        return len(self.descriptions) - 1

    def check(self, description: str, condition, from_module: bool, guard: Guard | None = None,
              subject: Path | None = None, uses: tuple = (), tensor_guards=None) -> None:
        """A check line; ``uses``: the variables (proxies) its condition reads;
        ``tensor_guards``: the ``TensorGuards`` it calls on them, if that is all it does."""
        index = self.number(description)
        tags = {MODULE_CHECK} if from_module else set()
        self.bsyms.append(glue.CHECK.bind(*uses, tags=tags, condition=condition, index=index,
                                          description=description, guard=guard, subject=subject,
                                          tensor_guards=tensor_guards))

    def guard(self, g: Guard) -> None:
        """The lines that check ``g``: its kind writes them (``capture/guards.py``)."""
        g.kind.check(self, g)


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
            b.bsyms.append(glue.BIND_SYMBOL.bind(entry.proxy, outputs=binding.proxy,
                                                 read=binding.read(), where=binding.where()))
    data = ctx.symbols.data_bindings
    bind_data_symbols(b, data)
    if check_values:
        # A guard may read an int computed from tensor data: then the checks come after it.
        b.bsyms.append(glue.CHECK_SIZES.bind(*ctx.symbols.proxies, symbols=ctx.symbols,
                                             tags={AFTER_STRUCTURE} if data else set()))


def bind_data_symbols(b: _Builder, data) -> None:
    """Compute each int the program reads from tensor data (``specialize_data=True``) with the
    lines that made it, and read it into its symbol (``s4 = t7.item()``); after the tensors are
    extracted, as data guards are."""
    emitted: set[int] = set()
    for binding in data:
        for line in binding.lines:
            if id(line) not in emitted:
                emitted.add(id(line))
                b.bsyms.append(line.replace(tags=line.tags | {AFTER_STRUCTURE}))
        b.bsyms.append(glue.BIND_SYMBOL.bind(binding.tensor, outputs=binding.proxy,
                                             read=binding.read(), where=binding.where(),
                                             tags={AFTER_STRUCTURE}))


def symbolic_tensor_guards(b: _Builder, entries) -> None:
    """One C++ call (dynamo's ``TensorGuards``) checking each tensor with symbolic sizes for its
    type, rank, dtype, device, requires_grad, dispatch keys, and the sizes and strides compiled
    as numbers; what is symbolic is checked against the symbols after they are bound."""
    def plain(values):
        return tuple(None if isinstance(v, torch.SymInt) else v for v in values)
    guards = SymbolicTensorGuards.of([e.real for e in entries],
                                     tuple(plain(e.fake.shape) for e in entries),
                                     tuple(plain(e.fake.stride()) for e in entries))
    names = tuple(e.proxy.name for e in entries)
    described = "; ".join(f"{e.path}: {e.real.dim()} dimensions, {e.real.dtype}, "
                          f"{e.real.device}, requires_grad {e.real.requires_grad}" for e in entries)
    b.check(f"{described} (and dispatch keys, and the sizes compiled as numbers)",
            lambda w: f"not {w.constant(guards, 'tensor_guards')}.check({', '.join(names)})",
            False, uses=tuple(e.proxy for e in entries), tensor_guards=guards)


class SymbolicTensorGuards:
    """dynamo's ``TensorGuards`` over the tensors with symbolic sizes (``check``, its C
    method), with what it was made of, so that a program loaded by another process
    (``persist/programs.py``) makes it again: each tensor's class, dtype, device, requires_grad
    and dispatch keys, and the sizes and strides compiled as numbers (None where symbolic)."""

    __slots__ = ("check", "tensors", "sizes", "strides")

    @classmethod
    def of(cls, reals: list, sizes: tuple, strides: tuple) -> "SymbolicTensorGuards":
        tensors = tuple((type(t), t.dtype, t.device, t.requires_grad,
                         str(dispatch_keys(t))) for t in reals)
        return cls(tensors, sizes, strides, reals)

    def __init__(self, tensors: tuple, sizes: tuple, strides: tuple, reals=None):
        from ..torch_internals.dynamo import TensorGuards
        if reals is None:  # made again: a plain tensor of each kind, with its dispatch keys
            reals = [_example(*t) for t in tensors]
        self.tensors, self.sizes, self.strides = tensors, sizes, strides
        self.check = TensorGuards(*reals, dynamic_dims_sizes=[list(s) for s in sizes],
                                  dynamic_dims_strides=[list(s) for s in strides]).check

    def __reduce__(self):
        return SymbolicTensorGuards, (self.tensors, self.sizes, self.strides)


def _example(cls: type, dtype, device, requires_grad: bool, keys: str) -> torch.Tensor:
    """A tensor that the guards compare a call's tensor with as with one of these (the guards
    read only its class, dtype, device, requires_grad and dispatch keys; their sizes are given)."""
    for inference in (False, True):  # a tensor made in inference mode has fewer keys
        with torch.inference_mode(inference):
            example = torch.empty(0, dtype=dtype, device=device,
                                  requires_grad=requires_grad and not inference)
            if cls is torch.nn.Parameter:
                example = torch.nn.Parameter(example, requires_grad=requires_grad)
        if type(example) is cls and str(dispatch_keys(example)) == keys:
            return example
    raise ValueError(f"no plain example of a {cls.__qualname__} with dispatch keys {keys}")


def check_symbolic_tensor(b: _Builder, ctx, entry) -> None:
    """The metadata check of a tensor with symbolic sizes: its shape and strides as expressions
    of the symbols (``(1, s0, 64)``, ``(64*s0, 64, 1)``)."""
    fake, code = entry.fake, ctx.symbols.code
    expected = glue.TensorMetadata(tuple(map(code, fake.shape)), tuple(map(code, fake.stride())),
                                   entry.real.dtype, entry.real.device, entry.real.requires_grad)
    index = b.number(f"tensor {entry.path} has shape {_show(expected.shape)} and stride "
                     f"{_show(expected.stride)} (its dtype, device and requires_grad are "
                     f"checked with the other tensors' in one call)")
    bound = frozenset(binding.dim for binding in ctx.symbols.bindings.values()
                      if binding.tensor is entry.proxy and binding.prop == "size")
    b.bsyms.append(glue.CHECK_SYMBOLIC_TENSOR.bind(entry.proxy, expected=expected, index=index,
                                                   bound_dims=bound))


def _show(values: tuple) -> str:
    return "(" + ", ".join(map(str, values)) + ("," if len(values) == 1 else "") + ")"


def build_prologue(ctx, params: list[TensorProxy], groups: list[MutableGroup],
                   pro_to_epi: list[Any], check_values: bool) -> tuple[Trace, list[str]]:
    b = _Builder(ctx, check_values)
    if check_values:
        for g in ctx.guards:
            if not g.kind.after_inputs:
                b.guard(g)
    for entry in ctx.inputs:
        b.var(entry.path, entry.proxy)
    if ctx.symbols is not None:
        bind_symbols(b, ctx, check_values)
    if check_values:
        for g in ctx.guards:
            if g.kind.after_inputs:  # it reads the tensors: after they are extracted
                b.guard(g)
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
                        uses=tuple(m.proxy for m in g.members))
                # A member may be a buffer, which the fast prologue loads with the module
                # structure: this check and the view must come after that.
                b.bsyms[-1].tags.add(AFTER_STRUCTURE)
            b.bsyms.append(glue.STORAGE_VIEW.bind(first.proxy, outputs=g.base, numel=n,
                                                  tags={AFTER_STRUCTURE}))
    if check_values:
        for entry in ctx.inputs:
            real = entry.real
            if ctx.symbols is not None and has_symbols(entry.fake):
                check_symbolic_tensor(b, ctx, entry)
                continue
            expected = glue.TensorMetadata(tuple(real.shape), tuple(real.stride()), real.dtype,
                                           real.device, real.requires_grad)
            index = b.number(f"tensor {entry.path} has the shape, stride, dtype, device and "
                             f"requires_grad it was compiled for")
            b.bsyms.append(glue.CHECK_TENSOR.bind(entry.proxy, tags=entry.proxy.tags,
                                                  expected=expected, index=index,
                                                  path=str(entry.path), real=weakref.ref(real)))
    epi_values = [b.var(x) if isinstance(x, Path) else x for x in pro_to_epi]
    b.bsyms.append(glue.RETURN_INPUTS.bind(list(params), epi_values))
    trace = Trace("prologue", ["*args", "**kwargs"], b.bsyms, ["Constructed by capture"],
                  namespace={"module": getattr(ctx, "root_module", None), **b.namespace})
    return trace, b.descriptions
