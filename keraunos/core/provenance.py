"""Provenance: where a value the program reads comes from, as a path from what the user passed.

A path prints two ways: for people (``args[0]``, ``module.transformer.h.0.attn.weight``) and as
the Python expression the prologue evaluates, step by step, to extract the value on every call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Path:
    """One step from ``parent``: an item, an attribute, a submodule, a parameter or a buffer.

    ``kind`` is ``root`` (``key`` names the root: ``args``, ``kwargs``, ``module``, or a namespace
    entry), ``item`` (``parent[key]``), ``attr`` (``parent.key``), ``submodule``, ``parameter``,
    ``buffer`` (entries of a module's ``_modules`` / ``_parameters`` / ``_buffers``), or ``view``
    (the whole storage of a tensor, as a flat view).
    """

    parent: "Path | None"
    kind: str
    key: Any

    def __str__(self) -> str:
        if self.kind == "root":
            return str(self.key)
        base = str(self.parent)
        if self.kind == "item":
            return f"{base}[{self.key!r}]"
        if self.kind == "view":
            return f"storage of {base}"
        return f"{base}.{self.key}"

    def expression(self, parent_var: str) -> str:
        """The Python expression that takes one step from a variable holding ``parent``."""
        if self.kind == "item":
            return f"{parent_var}[{self.key!r}]"
        if self.kind == "attr":
            return f"{parent_var}.{self.key}"
        if self.kind == "submodule":
            return f"{parent_var}._modules[{self.key!r}]"
        if self.kind == "parameter":
            return f"{parent_var}._parameters[{self.key!r}]"
        if self.kind == "buffer":
            return f"{parent_var}._buffers[{self.key!r}]"
        raise AssertionError(self.kind)

    def name_hint(self) -> str:
        """A short variable name for the value: the last one or two steps of the path."""
        if self.kind == "root":
            return str(self.key)
        key = str(self.key)
        if self.kind in ("parameter", "buffer", "attr") and self.parent is not None \
                and self.parent.kind == "submodule":
            return f"{self.parent._module_name()}_{key}"
        if self.kind == "item" and self.parent is not None:
            return f"{self.parent.name_hint()}_{key}"
        if self.kind == "submodule":
            return f"m_{self._module_name()}"
        return key

    def _module_name(self) -> str:
        """``qkv`` for ``...attn.qkv``; ``h0`` for ``...h.0`` (a list entry is named with its list)."""
        key = str(self.key)
        if key.isdigit():
            parent = self.parent
            return f"{parent.key if parent.kind == 'submodule' else 'layer'}{key}"
        return key

    def is_module_derived(self) -> bool:
        """Whether the path starts at the jitted module (rather than the call's arguments)."""
        p = self
        while p.parent is not None:
            p = p.parent
        return p.key == "module"

    def is_structural(self) -> bool:
        """Whether the path only walks the module tree's tables (submodules, parameters, buffers):
        what only a registration of a module, parameter or buffer can change."""
        if self.kind == "root":
            return self.key == "module"
        if self.kind == "attr" and self.key in ("_modules", "_parameters", "_buffers"):
            return self.parent.is_structural()
        return self.kind in ("submodule", "parameter", "buffer") and self.parent.is_structural()


def root(name: str) -> Path:
    return Path(None, "root", name)
