"""Return-value templates: what the epilogue rebuilds on every call, with proxies inside.

The user's return value (and every value the program writes to an attribute) becomes a template:
containers become ``Build`` nodes around their children, tensors become proxies of the
computation's outputs, or ``FromInput`` / ``ViewOf`` nodes for views that must be rebuilt outside
the computation, and objects the call passed in become ``ObjectRef``. The epilogue's glue lines
(``core/glue.py``) take templates as arguments and print them with ``template_code``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .proxies import TensorProxy
from .symbols import Code


@dataclass
class Build:
    """A node of the return-value template: a container to rebuild around its children."""

    python_type: type
    kind: str  # tuple, list, namedtuple, structseq, dict, dataclass, object, call
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
    offset: Any                 # an int, or a size expression
    grad: ViewGrad = ViewGrad.TRACKED
    absolute: bool = False
    name: str | None = None     # the epilogue variable holding the view, once bound


@dataclass(eq=False)
class ViewOf:
    """A returned view of a value the computation returns: rebuilt in the epilogue, outside the
    computation, so that it is an ordinary view (autograd forbids changing in place a view made
    inside a custom Function)."""

    base: Any  # a proxy the computation returns, or another node
    size: tuple
    stride: tuple
    offset: Any
    grad: ViewGrad = ViewGrad.TRACKED
    name: str | None = None


@dataclass(eq=False)
class ObjectRef:
    """An object that came with the call (a cache object), put somewhere by the program: the
    epilogue refers to the object the prologue finds at ``path``, never the capture's."""

    path: Any  # a core.provenance.Path
    name: str | None = None


def new_object(cls, state: dict):
    """An object of ``cls`` with this ``__dict__``, made without calling its ``__init__``."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def template_code(node: Any, w) -> str:
    """The Python expression that rebuilds a template node (``w``: a ``CodeWriter``)."""
    if isinstance(node, Build):
        return _build_code(node, w)
    if isinstance(node, ObjectRef):
        return node.name
    if isinstance(node, FromInput) and node.member is not None:
        return node.member.name
    if isinstance(node, (FromInput, ViewOf)):
        return node.name  # bound by a MAKE_VIEW line before it is used
    return w.value(node)


def _build_code(node: Build, w) -> str:
    return _REBUILD.get(node.kind, _rebuild_mapping)(node, w)


def _type_name(node: Build, w) -> str:
    return w.constant(node.python_type, node.python_type.__name__)


def _rebuild_sequence(node: Build, w) -> str:  # a tuple or a list
    return w.value(node.python_type(Code(template_code(c, w)) for c in node.children))


def _rebuild_object(node: Build, w) -> str:
    w.namespace["new_object"] = new_object
    items = ", ".join(f"{w.value(k)}: {template_code(c, w)}" for k, c in node.children.items())
    return f"new_object({_type_name(node, w)}, {{{items}}})"


def _rebuild_structseq(node: Build, w) -> str:
    return f"{_type_name(node, w)}((" + "".join(
        f"{template_code(c, w)}, " for c in node.children) + "))"


def _rebuild_namedtuple(node: Build, w) -> str:
    return f"{_type_name(node, w)}(" + ", ".join(template_code(c, w) for c in node.children) + ")"


def _rebuild_dataclass(node: Build, w) -> str:
    return f"{_type_name(node, w)}(" + ", ".join(f"{k}={template_code(c, w)}"
                                                 for k, c in node.children.items()) + ")"


def _rebuild_mapping(node: Build, w) -> str:  # a dict, or a dict subclass
    items = ", ".join(f"{w.value(k)}: {template_code(c, w)}" for k, c in node.children.items())
    if node.python_type is dict:
        return "{" + items + "}"
    return f"{_type_name(node, w)}({{{items}}})"


def _rebuild_call(node: Build, w) -> str:
    """A value made by a function of its children (``python_type`` is the function):
    ``rebuild_dtensor(local=t3, spec=_spec0)``."""
    function = w.constant(node.python_type, node.python_type.__name__)
    return f"{function}(" + ", ".join(f"{k}={template_code(c, w)}"
                                      for k, c in node.children.items()) + ")"


# How each kind of ``Build`` node is rebuilt; any other kind is a mapping.
_REBUILD = {"tuple": _rebuild_sequence, "list": _rebuild_sequence, "object": _rebuild_object,
            "structseq": _rebuild_structseq, "namedtuple": _rebuild_namedtuple,
            "dataclass": _rebuild_dataclass, "call": _rebuild_call}
