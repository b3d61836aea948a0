"""The epilogue: apply the program's side effects, then rebuild the user's return value.

``def epilogue(outputs, pro_to_epi)`` receives the computation's flat outputs and the values the
prologue extracted for it (written inputs, modules written to). It copies new values into inputs
and buffers written in place, replays attribute writes, and returns the user's structure: tuples,
lists, dicts, namedtuples, dataclasses (``ModelOutput`` included), with constants where the program
returned Python values.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core import glue
from ..core.proxies import ObjectProxy
from ..core.symbols import BoundSymbol
from ..core.templates import Build, FromInput, ObjectRef, ViewGrad, ViewOf
from ..core.trace import Trace
from ..errors import CaptureError
from ..core.provenance import Path
from ..core.symbolic import SymbolicValue


def template_of(value: Any, leaf, known: Callable[[Any], bool] = lambda obj: True,
                _building: set | None = None, number: Callable | None = None,
                reference: Callable | None = None) -> Any:
    """``value`` with every tensor replaced by ``leaf(tensor)`` and containers by ``Build`` nodes.

    An object the program made (``known(obj)`` is false: it existed before the call in no form
    the capture saw), such as a cache object it returns, is rebuilt on every call from its
    ``__dict__``, so that no call shares it and no capture-time tensor leaks out in it."""
    if isinstance(value, torch.Tensor):
        return leaf(value)
    ref = reference(value) if reference is not None else None
    if ref is not None:
        return ref
    if number is not None:  # symbolic sizes returned (``x.shape[1]``, ``x.shape``)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return number(value)
        if isinstance(value, torch.Size) and not all(type(n) is int for n in value):
            return _symbolic_size(value, number)
    if _building is None:
        _building = set()

    def child(v):
        return template_of(v, leaf, known, _building, number, reference)
    if (not known(value) and hasattr(value, "__dict__") and not isinstance(value, type)
            and not callable(value) and not isinstance(value, torch.nn.Module)
            and type(value).__module__ != "builtins" and not dataclasses.is_dataclass(value)):
        if id(value) in _building:
            raise CaptureError(f"keraunos: the program returns a {type(value).__qualname__} that "
                               f"contains itself; such objects cannot be rebuilt per call.")
        _building.add(id(value))
        state = {k: child(v) for k, v in vars(value).items()}
        _building.discard(id(value))
        return Build(type(value), "object", state)
    return _template_containers(value, child)


def _symbolic_size(size: torch.Size, number: Callable) -> SymbolicValue:
    dims = [number(n) for n in size]
    proxies = {p.name: p for d in dims if isinstance(d, SymbolicValue) for p in d.proxies}
    text = "torch.Size([" + ", ".join(str(d) for d in dims) + "])"
    return SymbolicValue(text, size, list(proxies.values()))


def _template_containers(value: Any, child) -> Any:
    if type(value) in (tuple, list):
        return Build(type(value), type(value).__name__, [child(v) for v in value])
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return Build(type(value), "namedtuple", [child(v) for v in value])
    if isinstance(value, tuple) and hasattr(type(value), "n_fields"):  # torch.return_types.*
        return Build(type(value), "structseq", [child(v) for v in value])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: child(getattr(value, f.name))
                  for f in dataclasses.fields(value) if f.init}
        return Build(type(value), "dataclass", fields)
    if isinstance(value, dict):
        return Build(type(value), "dict", {k: child(v) for k, v in value.items()})
    return value


def _symbolic_values(node) -> list[SymbolicValue]:
    """The symbolic sizes a template node reads itself (not those of its children)."""
    if isinstance(node, SymbolicValue):
        return [node]
    if isinstance(node, (FromInput, ViewOf)):
        return [v for v in (*node.size, *node.stride, node.offset)
                if isinstance(v, SymbolicValue)]
    return []


@dataclass
class Epilogue:
    trace: Trace
    # What the prologue must hand on, in order: tensor input proxies or module paths.
    info_pro_to_epi: list[Any]


def build_epilogue(ctx, out_template, flat_outputs, groups, writes,
                   container_writes=(), replays=()) -> Epilogue:
    """``replays``: (callable, the proxies it shows, label, source) of each print, log or
    warning of the program, made again after the writes, in program order."""
    pro_to_epi: list[Any] = []
    module_proxies: dict[Path, ObjectProxy] = {}

    def want(x):
        if isinstance(x, Path):
            if x not in module_proxies:
                module_proxies[x] = ObjectProxy(ctx.names.fresh(x.name_hint()), object,
                                                provenance=str(x))
                pro_to_epi.append(x)
            return module_proxies[x]
        if x not in pro_to_epi:
            pro_to_epi.append(x)
        return x

    body: list[BoundSymbol] = []
    for g in groups:
        body.append(glue.COPY_BACK.bind(want(g.base), g.updated, with_grad=g.with_grad,
                                        new_metadata=g.new_metadata))

    # Each returned view is made once, after the copy-backs, and bound to a name: a view the
    # program returns twice (or also writes to an attribute) is then one object, as in eager.
    views: list[FromInput | ViewOf] = []

    def mark_inputs(node):
        for v in _symbolic_values(node):  # the sizes a view or a returned number reads
            for p in v.proxies:
                want(p)
        if isinstance(node, ObjectRef):
            node.name = want(node.path).name
            return
        if isinstance(node, (FromInput, ViewOf)):
            if isinstance(node, FromInput):
                want(node.base)
                if node.member is not None:
                    want(node.member)
                    return
            else:
                mark_inputs(node.base)
            if all(v is not node for v in views):
                node.name = ctx.names.fresh("view")
                views.append(node)
        elif isinstance(node, Build):
            children = node.children.values() if isinstance(node.children, dict) else node.children
            for c in children:
                mark_inputs(c)
    mark_inputs(out_template)
    for _, value in writes:
        mark_inputs(value)
    for _, template in container_writes:
        mark_inputs(template)
    # Views that autograd must refuse are made (and their bases' versions bumped) first, so that
    # the bump leaves the other views fresh, as eager's are.
    views.sort(key=lambda v: not (v.grad is ViewGrad.NO_GRAD_THEN_WRITTEN
                                  and not isinstance(v.base, (FromInput, ViewOf))))
    body += [glue.MAKE_VIEW.bind(v) for v in views]
    for write, value in writes:
        body.append(glue.WRITE_ATTRIBUTE.bind(want(write.module_path), value, name=write.name))
    for path, template in container_writes:
        body.append(glue.WRITE_CONTAINER.bind(want(path), template))
    for replay, values, label, where in replays:
        for v in values:
            mark_inputs(v)  # the size symbols a symbolic size reads
        symbols = [p for v in values for s in _symbolic_values(v) for p in s.proxies]
        body.append(glue.REPLAY_CALL.bind(*values, *symbols, replay=replay, label=label,
                                          count=len(values), description=where))
    body.append(glue.RETURN_VALUE.bind(out_template))
    prologue_values = [module_proxies[x] if isinstance(x, Path) else x for x in pro_to_epi]
    head = [glue.UNPACK_OUTPUTS.bind(outputs=list(flat_outputs), origin="outputs"),
            glue.UNPACK_OUTPUTS.bind(outputs=prologue_values, origin="pro_to_epi")]
    trace = Trace("epilogue", ["outputs", "pro_to_epi"], head + body, ["Constructed by capture"])
    return Epilogue(trace, pro_to_epi)
