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
from enum import Enum
from typing import Any, Callable

import torch

from ..core.proxies import ObjectProxy, TensorProxy
from ..core.symbols import BoundSymbol, Code, GlueSymbol
from ..core.trace import Trace
from ..errors import CaptureError
from .provenance import Path
from .symbolic import SymbolicValue


@dataclass
class Build:
    """A node of the return-value template: a container to rebuild around its children."""

    python_type: type
    kind: str  # tuple, list, namedtuple, dict, dataclass
    children: Any  # list for sequences, dict for mappings and dataclasses


class ViewGrad(Enum):
    """How autograd saw a returned view when the program made it; the epilogue makes it so."""

    TRACKED = "tracked"    # an ordinary view: gradients flow to what it views
    DETACHED = "detached"  # x.detach() (and views of it): no grad, no gradient flow
    NO_GRAD = "no_grad"    # a view made under torch.no_grad(): no grad_fn, as in eager
    # A view made under no_grad whose base the program then wrote in place: autograd refuses to
    # use it afterwards (eager's own raises "A view was created in no_grad mode ..."); the view
    # is made after the write here, so the base's version is bumped once more after it.
    NO_GRAD_THEN_WRITTEN = "no_grad, then its base written"


@dataclass(eq=False)
class FromInput:
    """A returned tensor that lives in the memory of an input: the input itself (``member``), or
    a view of ``base`` rebuilt on every call (after the copy-back when the program wrote there).

    ``offset`` counts from the base's storage offset *at call time*: the same program serves a
    slice of a larger tensor at another offset, and its returned views must follow. Only a view
    the program made with ``as_strided`` has an ``absolute`` offset, the one it named."""

    member: TensorProxy | None  # the input itself
    base: TensorProxy           # what the view is of: the input, or a flat view of its storage
    size: tuple
    stride: tuple
    offset: int
    grad: ViewGrad = ViewGrad.TRACKED
    absolute: bool = False
    name: str | None = None     # the epilogue variable holding the view, once bound


@dataclass(eq=False)
class ViewOf:
    """A returned view of a value the computation returns: rebuilt here, outside the
    computation, so that it is an ordinary view (autograd forbids changing in place a view made
    inside a custom Function)."""

    base: Any  # a proxy the computation returns, or another node
    size: tuple
    stride: tuple
    offset: int
    grad: ViewGrad = ViewGrad.TRACKED
    name: str | None = None


@dataclass(eq=False)
class ObjectRef:
    """An object that came with the call (a cache object), put somewhere by the program: the
    epilogue refers to the object the prologue finds at ``path``, never the capture's."""

    path: Path
    name: str | None = None


def new_object(cls, state: dict):
    """An object of ``cls`` with this ``__dict__``, made without calling its ``__init__``."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


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


def _code(node: Any, w) -> str:
    if isinstance(node, Build):
        if node.kind in ("tuple", "list"):
            return w.value(node.python_type(Code(_code(c, w)) for c in node.children))
        if node.kind == "object":
            w.namespace["new_object"] = new_object
            items = ", ".join(f"{w.value(k)}: {_code(c, w)}" for k, c in node.children.items())
            return f"new_object({w.constant(node.python_type, node.python_type.__name__)}, " \
                   f"{{{items}}})"
        if node.kind == "structseq":
            return f"{w.constant(node.python_type, node.python_type.__name__)}((" + \
                "".join(f"{_code(c, w)}, " for c in node.children) + "))"
        if node.kind == "namedtuple":
            return f"{w.constant(node.python_type, node.python_type.__name__)}(" + \
                ", ".join(_code(c, w) for c in node.children) + ")"
        if node.kind == "dataclass":
            return f"{w.constant(node.python_type, node.python_type.__name__)}(" + \
                ", ".join(f"{k}={_code(c, w)}" for k, c in node.children.items()) + ")"
        items = ", ".join(f"{w.value(k)}: {_code(c, w)}" for k, c in node.children.items())
        if node.python_type is dict:
            return "{" + items + "}"
        return f"{w.constant(node.python_type, node.python_type.__name__)}({{{items}}})"
    if isinstance(node, ObjectRef):
        return node.name
    if isinstance(node, FromInput) and node.member is not None:
        return node.member.name
    if isinstance(node, (FromInput, ViewOf)):
        return node.name  # bound by a MAKE_VIEW line before it is used
    return w.value(node)


def _view_formatter(bsym, w):
    node = bsym.args[0]
    base = _code(node.base, w)
    source = f"{base}.detach()" if node.grad is ViewGrad.DETACHED else base
    if getattr(node, "absolute", False):
        offset = str(node.offset)
    else:
        offset = f"{base}.storage_offset()" + (f" + ({node.offset})" if isinstance(
            node.offset, SymbolicValue) else f" + {node.offset}" if node.offset else "")
    line = (f"{node.name} = {source}.as_strided({w.value(node.size)}, {w.value(node.stride)}, "
            f"{offset})")
    if node.grad is ViewGrad.NO_GRAD_THEN_WRITTEN:
        return [f"with torch.no_grad(): {line}  # the program made this view under no_grad",
                f"torch.autograd.graph.increment_version({base})  # ... then wrote {base}"]
    if node.grad is ViewGrad.NO_GRAD:
        return [f"with torch.no_grad(): {line}  # the program made this view under no_grad"]
    return [line]


def _unpack_formatter(bsym, w):
    names = [p.name for p in bsym.outputs]
    if not names:
        return []
    target = ", ".join(names) + ("," if len(names) == 1 else "")
    return [f"{target} = {bsym.args[0]}"]


def _copy_back_formatter(bsym, w):
    copy = f"{bsym.args[0].name}.copy_({bsym.args[1].name})"
    meta = bsym.info.get("new_metadata")
    if meta is not None:  # the program changed the input's shape or strides in place
        shape, stride, offset_change, resized = meta
        name = bsym.args[0].name
        prefix = f"{name}.resize_({shape}); " if resized else ""
        offset = f"{name}.storage_offset()" + (f" + {offset_change}" if offset_change else "")
        copy = f"{prefix}{name}.as_strided_({shape}, {stride}, {offset}); {copy}"
    if not bsym.info.get("with_grad", True):
        return [f"with torch.no_grad(): {copy}  # written in place by the program, under no_grad"]
    return [f"{copy}  # written in place by the program"]


def _write_formatter(bsym, w):
    module, name, value = bsym.args
    code = _code(value, w)
    if name.isidentifier():
        return [f"{module.name}.{name} = {code}"]
    return [f"setattr({module.name}, {name!r}, {code})"]


def _return_formatter(bsym, w):
    return [f"return {_code(bsym.args[0], w)}"]


def _symbolic_values(node) -> list[SymbolicValue]:
    """The symbolic sizes a template node reads itself (not those of its children)."""
    if isinstance(node, SymbolicValue):
        return [node]
    if isinstance(node, (FromInput, ViewOf)):
        return [v for v in (*node.size, *node.stride, node.offset)
                if isinstance(v, SymbolicValue)]
    return []


UNPACK = GlueSymbol("unpack", _unpack_formatter)
COPY_BACK = GlueSymbol("copy_back", _copy_back_formatter)
WRITE_ATTRIBUTE = GlueSymbol("write_attribute", _write_formatter)
RETURN_VALUE = GlueSymbol("return_value", _return_formatter)
MAKE_VIEW = GlueSymbol("make_view", _view_formatter)


@dataclass
class Epilogue:
    trace: Trace
    # What the prologue must hand on, in order: tensor input proxies or module paths.
    info_pro_to_epi: list[Any]


def _container_formatter(bsym, w):
    container, template = bsym.args
    if isinstance(template, Build) and template.kind == "list":
        return [f"{container.name}[:] = {_code(template, w)}  # the program changed this list"]
    return [f"{container.name}.clear()",
            f"{container.name}.update({_code(template, w)})  # the program changed this dict"]


WRITE_CONTAINER = GlueSymbol("write_container", _container_formatter)


def build_epilogue(ctx, out_template, flat_outputs, groups, writes,
                   container_writes=()) -> Epilogue:
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
        body.append(BoundSymbol(COPY_BACK, (want(g.base), g.updated),
                                info={"with_grad": g.with_grad, "new_metadata": g.new_metadata}))

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
        elif isinstance(node, Build) and node.kind == "object":
            for c in node.children.values():
                mark_inputs(c)
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
    body += [BoundSymbol(MAKE_VIEW, (v,)) for v in views]
    for write, value in writes:
        body.append(BoundSymbol(WRITE_ATTRIBUTE, (want(write.module_path), write.name, value)))
    for path, template in container_writes:
        body.append(BoundSymbol(WRITE_CONTAINER, (want(path), template)))
    body.append(BoundSymbol(RETURN_VALUE, (out_template,)))
    prologue_values = [module_proxies[x] if isinstance(x, Path) else x for x in pro_to_epi]
    head = [BoundSymbol(UNPACK, ("outputs",), outputs=list(flat_outputs)),
            BoundSymbol(UNPACK, ("pro_to_epi",), outputs=prologue_values)]
    trace = Trace("epilogue", ["outputs", "pro_to_epi"], head + body, ["Constructed by capture"])
    return Epilogue(trace, pro_to_epi)
