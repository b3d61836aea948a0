"""A readable prologue's checks aimed at other objects than those it was captured for: a
program made for one module serving an identical one (``runtime/rebind.py``), a program kept
between processes serving this process's objects (``persist/programs.py``)."""
from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..core import glue
from ..torch_internals.dispatch import dispatch_keys
from .guards import VALUE, same_value


def with_example(line, value_of: dict):
    """A tensor check whose example for the C++ checks is this call's tensor (None when that
    tensor is not of the compiling call's type and dispatch keys): for a prologue that serves
    other tensors than those it was captured with (``rebind.py``, ``program_store.py``).
    ``value_of``: the tensors the readable prologue returned for this call, by name."""
    if line.symbol is not glue.CHECK_TENSOR:
        return line
    tensor = value_of.get(line.args[0].name)
    if not isinstance(tensor, torch.Tensor):
        return None
    compiled_for = line.fields.real()
    if compiled_for is None:  # gone: only a plain tensor is known to check alike
        e = line.fields.expected
        if e.dtype.is_complex:
            return None
        compiled_for = torch.empty(0, dtype=e.dtype, device=e.device,
                                   requires_grad=e.requires_grad and e.dtype.is_floating_point)
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return None
    elif type(tensor) is not type(compiled_for):
        return None
    if dispatch_keys(tensor) != dispatch_keys(compiled_for):
        return None
    return line.replace(fields=replace(line.fields, real=weakref.ref(tensor)))


def expecting_values_of(line, module: torch.nn.Module):
    """A check that a module attribute has a value (``eps == 1e-05``), expecting ``module``'s own
    object where it has that value: the fast prologue checks such attributes by identity with
    the object compiled for, and two identical modules hold equal values in objects of their
    own (``normalized_shape``, a tuple each). Where the value differs, the check stays, and
    fails: the program is not for ``module``."""
    guard = getattr(line.fields, "guard", None)
    if line.symbol is not glue.CHECK or guard is None or guard.kind is not VALUE \
            or not guard.from_module or guard.path is None:
        return line
    try:
        value = _value_at(guard.path, module)
    except Exception:  # noqa: BLE001 - not there: the check fails as it is
        return line
    if value is guard.expected or not same_value(value, guard.expected):
        return line
    return line.replace(fields=replace(line.fields, guard=replace(guard, expected=value)))


def _value_at(path, module):
    if path.is_root:
        if path.key != "module":
            raise KeyError(path.key)
        return module
    return eval(path.expression("parent"), {"parent": _value_at(path.parent, module)})
