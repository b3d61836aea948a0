"""Provenance: where a value the program reads comes from, as a path from what the user passed.

A path prints two ways: for people (``args[0]``, ``module.transformer.h.0.attn.weight``) and as
the Python expression the prologue evaluates, step by step, to extract the value on every call.
Each kind of step is one ``PathKind``, defined here once (``ROOT``, ``ITEM``, ``ATTR``,
``SUBMODULE``, ``PARAMETER``, ``BUFFER``, ``VIEW``) with both printings and the variable name it
suggests; kinds are compared by identity, and callers ask a path (``path.is_root``), not its kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# The tables of a module that hold its submodules, parameters and buffers.
MODULE_TABLES = ("_modules", "_parameters", "_buffers")


class PathKind:
    """One kind of step from a parent value. ``show(base, key)``: the step for people, after the
    parent's text; ``step(var, key)``: the Python expression that takes it from a variable holding
    the parent (``None``: the step is not taken by the prologue); ``hint(path)``: a short variable
    name for the value; ``table``: the module table the step reads an entry of, if one."""

    def __init__(self, name: str, show: Callable[[str, Any], str],
                 step: Callable[[str, Any], str] | None, hint: Callable[["Path"], str],
                 table: str | None = None):
        self.name = name
        self.show = show
        self.step = step
        self.hint = hint
        self.table = table

    def __repr__(self) -> str:
        return repr(self.name)

    def __reduce__(self) -> str:  # copies and pickles are the one object of this module
        return self.name.upper()


@dataclass(frozen=True)
class Path:
    """One step from ``parent``, of a ``PathKind``.

    ``kind`` is ``ROOT`` (``key`` names the root: ``args``, ``kwargs``, ``module``, or a namespace
    entry; ``parent`` is None), ``ITEM`` (``parent[key]``), ``ATTR`` (``parent.key``),
    ``SUBMODULE``, ``PARAMETER``, ``BUFFER`` (entries of a module's ``_modules`` /
    ``_parameters`` / ``_buffers``), or ``VIEW`` (the whole storage of a tensor, as a flat view).
    """

    parent: "Path | None"
    kind: PathKind
    key: Any

    def __str__(self) -> str:
        if self.is_root:
            return str(self.key)
        return self.kind.show(str(self.parent), self.key)

    @property
    def is_root(self) -> bool:
        return self.kind is ROOT

    @property
    def is_item(self) -> bool:
        return self.kind is ITEM

    @property
    def is_attr(self) -> bool:
        return self.kind is ATTR

    @property
    def is_submodule(self) -> bool:
        return self.kind is SUBMODULE

    @property
    def origin(self) -> "Path":
        """The root the path starts from."""
        p = self
        while p.parent is not None:
            p = p.parent
        return p

    def expression(self, parent_var: str) -> str:
        """The Python expression that takes one step from a variable holding ``parent``."""
        if self.kind.step is None:
            raise AssertionError(self.kind)
        return self.kind.step(parent_var, self.key)

    def name_hint(self) -> str:
        """A short variable name for the value: the last one or two steps of the path."""
        return self.kind.hint(self)

    def _module_name(self) -> str:
        """``qkv`` for ``...attn.qkv``; ``h0`` for ``...h.0`` (a list entry is named with its list)."""
        key = str(self.key)
        if key.isdigit():
            parent = self.parent
            return f"{parent.key if parent.is_submodule else 'layer'}{key}"
        return key

    def is_module_derived(self) -> bool:
        """Whether the path starts at the jitted module (rather than the call's arguments)."""
        return self.origin.key == "module"

    def is_structural(self) -> bool:
        """Whether the path only walks the module tree's tables (submodules, parameters, buffers):
        what only a registration of a module, parameter or buffer can change."""
        if self.is_root:
            return self.key == "module"
        if self.kind.table is not None or (self.is_attr and self.key in MODULE_TABLES):
            return self.parent.is_structural()
        return False


def _key_hint(path: Path) -> str:
    return str(path.key)


def _member_hint(path: Path) -> str:
    """A module's member is named with its module: ``qkv_weight``."""
    if path.parent is not None and path.parent.is_submodule:
        return f"{path.parent._module_name()}_{path.key}"
    return str(path.key)


def _item_hint(path: Path) -> str:
    return f"{path.parent.name_hint()}_{path.key}" if path.parent is not None else str(path.key)


def _table_step(table: str) -> Callable[[str, Any], str]:
    return lambda var, key: f"{var}.{table}[{key!r}]"


def _dotted(base: str, key: Any) -> str:
    return f"{base}.{key}"


ROOT = PathKind("root", lambda base, key: str(key), None, _key_hint)
ITEM = PathKind("item", lambda base, key: f"{base}[{key!r}]", lambda var, key: f"{var}[{key!r}]",
                _item_hint)
ATTR = PathKind("attr", _dotted, lambda var, key: f"{var}.{key}", _member_hint)
SUBMODULE = PathKind("submodule", _dotted, _table_step("_modules"),
                     lambda path: f"m_{path._module_name()}", table="_modules")
PARAMETER = PathKind("parameter", _dotted, _table_step("_parameters"), _member_hint,
                     table="_parameters")
BUFFER = PathKind("buffer", _dotted, _table_step("_buffers"), _member_hint, table="_buffers")
VIEW = PathKind("view", lambda base, key: f"storage of {base}", None, _key_hint)
# What a weak reference refers to (``opt_ref()``, the optimizer an LR scheduler's wrapper of
# ``optimizer.step`` holds weakly).
CALL = PathKind("call", lambda base, key: f"{base}()", lambda var, key: f"{var}()",
                lambda path: "referent")
# The keys and the values of a mapping, as lists: a mapping keyed by objects (an optimizer's
# ``state``, keyed by its parameters) is read by position (``list(state.values())[3]``).
KEYS_OF = PathKind("keys_of", lambda base, key: f"list({base})", lambda var, key: f"list({var})",
                   lambda path: f"{path.parent.name_hint()}_keys")
VALUES_OF = PathKind("values_of", lambda base, key: f"list({base}.values())",
                     lambda var, key: f"list({var}.values())",
                     lambda path: f"{path.parent.name_hint()}_values")


class FoundByName(str):
    """The name of a root the program finds by name besides the jitted function's own globals
    and closure (a helper's globals, a closure cell, a jitted bound method's object): a name of
    the prologue's namespace whose type says so, for those that ask (``capture/inputs.py``)."""

    __slots__ = ()


def root(name: str) -> Path:
    return Path(None, ROOT, name)
