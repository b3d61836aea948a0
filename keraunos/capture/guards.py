"""Guards: what the prologue must check for a cached program to be valid for a call.

Capture records a guard for every value the program's behaviour depended on: Python values by
value, containers by type and length or keys, objects by identity, tensors by metadata, global
state. Each kind of guard is one ``GuardKind``, defined here once with the two things it knows:
what a cache-miss explanation says when its check fails (``describe``), and the prologue lines
that check it (``check``, given the prologue builder of ``capture/prologue.py``). Kinds are
compared by identity (``g.kind is IDENTITY``); a new kind is one more entry at the end.
"""
from __future__ import annotations

import copy
import enum
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core import glue
from ..core.provenance import MODULE_TABLES, Path
from ..core.tags import AFTER_STRUCTURE, MODULE_CHECK

# Values compared by equality (after an exact type check).
PLAIN_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size,
               slice, type(Ellipsis), torch.memory_format, torch.layout)
if torch.distributed.is_available():  # dist.ReduceOp.SUM, an argument of the collectives
    PLAIN_TYPES += (torch.distributed.ReduceOp.RedOpType,)


def _is_placement(value: Any) -> bool:
    """A DTensor placement (``Shard(0)``, ``Replicate()``): immutable, compared by equality."""
    placements = sys.modules.get("torch.distributed.tensor.placement_types")
    return placements is not None and isinstance(value, placements.Placement)


def is_plain(value: Any) -> bool:
    if isinstance(value, PLAIN_TYPES) or isinstance(value, enum.Enum) or _is_placement(value):
        return True
    if type(value) in (tuple, list):
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


class GuardKind:
    """One kind of guard.

    ``describe(guard)``: the sentence a cache-miss explanation shows when the check fails.
    ``check(builder, guard)``: writes the prologue lines that check it, with the builder's
    ``var(path, proxy=None)`` (the variable holding a value, unpacked on first use),
    ``check(description, condition, from_module, guard=, subject=, uses=)`` (one check line) and
    ``number(description)`` (the index a check line of its own returns when it fails).
    ``after_inputs``: checked after the tensor inputs are extracted, because it reads them.
    ``same_object_passes(expected)``: whether the check passes for the very object compiled for,
    so that the fast prologue may check a module attribute by identity instead.
    ``only_that_object``: the check passes for that object alone, so its own attributes can be
    read (from its ``__dict__``) as a module's are.
    """

    def __init__(self, name: str, describe: Callable[["Guard"], str],
                 check: Callable[[Any, "Guard"], None], *, after_inputs: bool = False,
                 same_object_passes: Callable[[Any], bool] = lambda expected: False,
                 only_that_object: bool = False):
        self.name = name
        self.describe = describe
        self.check = check
        self.after_inputs = after_inputs
        self.same_object_passes = same_object_passes
        self.only_that_object = only_that_object

    def __repr__(self) -> str:
        return repr(self.name)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class DataRead:
    """Where a data guard's value comes from: ``target.method()`` (``t3.item()``) after the
    computation ``lines`` that made ``target`` from the inputs, read by the program at ``source``."""

    lines: list
    target: Any  # a TensorProxy
    method: str
    source: str


@dataclass
class Guard:
    """One check: the value at ``path`` (or, for a guard on global state, the value of the Python
    ``expression``, with ``path`` None) is ``expected``, in the sense of its ``kind``.
    ``from_module``: the path starts at the jitted module. ``read``: a data guard's ``DataRead``."""

    kind: GuardKind
    path: Path | None
    expected: Any
    expression: str | None = None
    from_module: bool = False
    read: DataRead | None = None

    @property
    def where(self) -> str:
        return self.expression if self.path is None else str(self.path)

    @property
    def description(self) -> str:
        return self.kind.describe(self)

    def passes_for_same_object(self) -> bool:
        """Whether the check passes whenever the value is the very object compiled for."""
        return self.kind.same_object_passes(self.expected)


def _subject_var(b, g: Guard):
    """The variable holding the guarded value, and a ``check`` that reads it and is about it."""
    p = b.var(g.path)
    return p, functools.partial(b.check, guard=g, subject=g.path, uses=(p,))


# --- value: a plain Python value, compared by type and equality ------------------------------

def _describe_value(g: Guard) -> str:
    return f"{g.where} == {g.expected!r} ({type(g.expected).__name__})"


def _check_value(b, g: Guard) -> None:
    p, check = _subject_var(b, g)
    check(g.description, lambda w: _value_condition(p.name, g.expected, w), g.from_module)


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


# --- global: a value of global state, read by a Python expression -----------------------------

def _check_global(b, g: Guard) -> None:
    expected = g.expected
    b.check(g.description, lambda w: f"{g.expression} is not {w.value(expected)}"
            if isinstance(expected, (bool, torch.dtype)) or expected is None
            else f"{g.expression} != {w.value(expected)}", False)


# --- identity: the very object compiled for, or the same tensor as another input --------------

def _describe_identity(g: Guard) -> str:
    if hasattr(g.expected, "proxy"):  # a tensor reached two ways (tied weights)
        return f"{g.where} is the same tensor as {g.expected.path}"
    return f"{g.where} is the same object as when compiled ({type(g.expected).__name__})"


def _check_identity(b, g: Guard) -> None:
    p, check = _subject_var(b, g)
    other = g.expected
    if hasattr(other, "proxy") and hasattr(other, "fake"):  # another tensor input
        first = b.var(other.path, other.proxy)
        b.bsyms.append(glue.CHECK_ALIAS.bind(
            p, first, tags={MODULE_CHECK} if g.from_module else (),
            index=b.number(g.description), description=g.description,
            paths=(g.path, other.path)))
    elif not _held_by_the_prologue(b, g.path, other):
        check(g.description, lambda w: f"{p.name} is not {w.constant(other, 'obj')}",
              g.from_module)


def _held_by_the_prologue(b, path, value) -> bool:
    """Whether ``path`` is a root the prologue reads from its own reference to ``value`` (an
    object passed in and read as found by name, a helper's globals): the same object by
    construction, so a check of it could not fail."""
    return path.is_root and path.key not in b.roots and b.ctx.root_objects.get(path.key) is value


# --- type, length, keys: a container or an object passed in ----------------------------------

def _check_type(b, g: Guard) -> None:
    p, check = _subject_var(b, g)
    cls = g.expected
    check(g.description, lambda w: f"type({p.name}) is not {w.constant(cls, cls.__name__)}",
          g.from_module)


def _describe_length(g: Guard) -> str:
    python_type, n = g.expected
    return f"{g.where} is a {python_type.__name__} of length {n}"


def _check_length(b, g: Guard) -> None:
    p, check = _subject_var(b, g)
    v = p.name
    python_type, n = g.expected
    if g.path.is_root:  # args is a tuple
        check(g.description, lambda w: f"len({v}) != {n}", False)
    else:
        check(g.description, lambda w: f"type({v}) is not "
              f"{w.constant(python_type, python_type.__name__)} or len({v}) != {n}",
              g.from_module)


def _describe_keys(g: Guard) -> str:
    python_type, keys = g.expected
    if not keys:
        return f"{g.where} is empty"
    return f"{g.where} is a {python_type.__name__} with keys {list(keys)}"


def _check_keys(b, g: Guard) -> None:
    p, check = _subject_var(b, g)
    v = p.name
    _, keys = g.expected
    if g.path.is_root and not keys:  # kwargs is a dict
        check(g.description, lambda w: f"{v}", False)
    elif g.path.is_root or g.path.key in MODULE_TABLES:
        check(g.description, lambda w: f"list({v}) != {w.value(list(keys))}", g.from_module)
    else:
        python_type = g.expected[0]
        check(g.description, lambda w: f"type({v}) is not "
              f"{w.constant(python_type, python_type.__name__)} or list({v}) != "
              f"{w.value(list(keys))}", g.from_module)


# --- symbolic int: an int argument compiled as a size symbol ---------------------------------

def _check_symbolic_number(b, g: Guard) -> None:
    p = b.var(g.path, g.expected)  # the number is the symbol: s0 = args[1]
    kind = g.expected.python_type.__name__
    b.check(g.description, lambda w: f"type({p.name}) is not {kind}", False, uses=(p,))


# --- absent: an attribute the program found missing ------------------------------------------

def _describe_absent(g: Guard) -> str:
    return f"{g.where} does not exist"


def _check_absent_attribute(b, g: Guard) -> None:  # of a plain object passed in
    parent = b.var(g.path.parent)
    name = g.path.key
    b.check(g.description, lambda w: f"{name!r} in {parent.name}.__dict__", False,
            guard=g, uses=(parent,))


def _check_absent(b, g: Guard) -> None:  # of a module: in none of its tables
    parent = b.var(g.path.parent)
    name = g.path.key
    b.check(g.description, lambda w: " or ".join(
        f"{name!r} in {parent.name}.{table}"
        for table in ("__dict__", "_parameters", "_buffers", "_modules")), g.from_module, guard=g, subject=g.path, uses=(parent,))


# --- data: a value read from tensor data (specialize_data=True), recomputed per call -----------

def _describe_data(g: Guard) -> str:
    return (f"{g.where} == {g.expected!r}, a value read from tensor data at "
            f"{g.read.source} (specialize_data=True)")


def _check_data(b, g: Guard) -> None:
    """Recompute the value with the ops that made it, and check it."""
    read = g.read
    for line in read.lines:
        b.bsyms.append(line.replace(tags=line.tags | {AFTER_STRUCTURE}))
    expected = g.expected
    b.check(g.description, lambda w: f"{read.target.name}.{read.method}() != {w.value(expected)}"
            if _is_plain_scalar(expected) else
            f"{read.target.name}.{read.method}() != {w.constant(expected, 'expected')}", False,
            uses=(read.target,))
    b.bsyms[-1].tags.add(AFTER_STRUCTURE)


def _is_plain_scalar(v) -> bool:
    return v is None or type(v) in (bool, int, float, str)


# --- ambient: grad mode, autocast and the rest of capture/ambient.py's list --------------------

def _check_ambient(b, g: Guard) -> None:
    """As at capture: the settings dynamo's C++ guard covers in one call of it, the others one
    line each."""
    snapshot = g.expected
    if snapshot.cxx_guard is not None:
        name = f"_global_state{len(b.namespace)}"
        b.namespace[name] = snapshot.cxx_guard
        b.check(snapshot.cxx_description(), lambda w: f"not {name}.check()", False)
    for ambient, value in snapshot.python_checked():
        b.namespace.update(ambient.names)  # the C functions it calls, by names of their own
        b.check(snapshot.description(ambient, value),
                lambda w, a=ambient, v=value: f"{a.expression} is not {w.value(v)}"
                if isinstance(v, (bool, torch.dtype)) or v is None
                else f"{a.expression} != {w.value(v)}", False)


VALUE = GuardKind("value", _describe_value, _check_value,
                  same_object_passes=lambda e: not hasattr(e, "proxy")
                  and not isinstance(e, (list, dict, set)))
GLOBAL = GuardKind("global", _describe_value, _check_global)
IDENTITY = GuardKind("identity", _describe_identity, _check_identity,
                     same_object_passes=lambda e: not hasattr(e, "proxy"), only_that_object=True)
TYPE = GuardKind("type", lambda g: f"type({g.where}) is {g.expected.__qualname__}", _check_type)
LENGTH = GuardKind("length", _describe_length, _check_length)
KEYS = GuardKind("keys", _describe_keys, _check_keys)
SYMBOLIC_INT = GuardKind("symbolic int", lambda g: f"{g.where} is an int (compiled as the "
                         f"symbol {g.expected.name})", _check_symbolic_number)
SYMBOLIC_FLOAT = GuardKind("symbolic float", lambda g: f"{g.where} is a float (compiled as "
                           f"the symbol {g.expected.name})", _check_symbolic_number)
ABSENT_ATTRIBUTE = GuardKind("absent attribute", _describe_absent, _check_absent_attribute)
ABSENT = GuardKind("absent", _describe_absent, _check_absent)
DATA = GuardKind("data", _describe_data, _check_data, after_inputs=True)
# A plain value held by a tensor input (``p.grad is None``): read from the tensor's variable, so
# checked once the tensor inputs are extracted.
TENSOR_ATTRIBUTE = GuardKind("tensor attribute", _describe_value, _check_value, after_inputs=True)
AMBIENT = GuardKind("ambient", lambda g: "the ambient state (grad mode, autocast, ...) is as when "
                    "compiled", _check_ambient)
