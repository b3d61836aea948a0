"""Capture-time values must never reach the user: finding FakeTensors in what a call returns.

Capture runs the program on FakeTensors. What it hands back is rebuilt from templates (tensors
become the computation's outputs), but an object the program made and the templates keep as it
was (a module built inside the program, a tensor subclass wrapping fake tensors) would carry
capture's FakeTensors out. ``capture_values_in`` finds them; capture refuses such a program, and
with ``KERAUNOS_CHECK_RESULTS=1`` every call's result is searched too (the test suite runs so).
Capture's writes to what the user keeps (a module's dict it fills on a first call) go to stand-ins
and are replayed by the epilogue with real tensors; ``capture_values_in_user_state`` checks that
none reached the user's own objects, after every capture in the test suite and in debug mode.
"""
from __future__ import annotations

from typing import Any

import torch

from ..torch_internals.dispatch import NO_TORCH_DISPATCH, is_traceable_wrapper_subclass
from ..torch_internals.fake import FakeTensor
from .recording import ORIGINAL

_NO_DISPATCH = NO_TORCH_DISPATCH


def is_tensor_subclass_with_dispatch(t: torch.Tensor) -> bool:
    """A tensor whose type runs its own ``__torch_dispatch__`` (a subclass made with
    ``_make_wrapper_subclass``): its ops are not the ops of a plain tensor of its shape. Capture
    takes DTensors apart itself (``dtensor.py``); it refuses the others."""
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    return (is_traceable_wrapper_subclass(t)
            or getattr(cls, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH)


def capture_values_in(value: Any, where: str = "the result", depth: int = 4,
                      _seen: set | None = None) -> str | None:
    """Where in ``value`` a FakeTensor is (``"the result[0].weight"``), or an object still
    wearing one of capture's recording classes, or ``None``. Containers,
    modules' parameters and buffers, tensor subclasses' inner tensors and objects' ``__dict__``
    are searched, ``depth`` levels of objects deep."""
    if _seen is None:
        _seen = set()
    if id(value) in _seen or value is None or isinstance(value, (bool, int, float, str, bytes)):
        return None
    _seen.add(id(value))
    if isinstance(value, FakeTensor):
        return where
    if ORIGINAL in type(value).__dict__:
        return f"{where} (an object still wearing capture's recording class)"
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                found = capture_values_in(getattr(value, name), f"{where}.{name}", depth, _seen)
                if found:
                    return found
        return None
    if isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, torch.nn.Module):
        items = [*value.named_parameters(), *value.named_buffers()]
        return next((f"{where}.{name}" for name, t in items if isinstance(t, FakeTensor)), None)
    elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type) and (
            type(value).__module__ != "builtins"):
        return _search_attributes(value, where, depth, _seen)
    else:
        return None
    for key, item in items:
        found = capture_values_in(item, f"{where}[{key!r}]", depth, _seen)
        if found:
            return found
    return None


def _search_attributes(value, where, depth, seen):
    try:
        attributes = vars(value)
    except TypeError:
        return None
    for key, item in list(attributes.items()):
        found = capture_values_in(item, f"{where}.{key}", depth - 1, seen)
        if found:
            return found
    return None


# A module's own tables, searched through ``named_parameters`` and ``named_buffers`` (and their
# ``.grad``) instead; hooks are the user's functions, not state a program writes.
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


def capture_values_in_user_state(module: torch.nn.Module | None, args: tuple, kwargs: dict,
                                 depth: int = 3) -> str | None:
    """Where a FakeTensor of capture's is in what the user's code keeps after a capture: the
    module tree's attributes (the dicts and lists a module fills, ``attention_bias_cache``), its
    parameters' and buffers' gradients, and the objects passed in (a KV cache); or ``None``.
    Asked after every capture under ``KERAUNOS_CHECK_RESULTS=1`` (the test suite) and
    ``KERAUNOS_DEBUG``."""
    seen: set[int] = set()
    if module is not None:
        for name, sub in module.named_modules(remove_duplicate=True):
            prefix = f"module.{name}" if name else "module"
            for key, value in list(vars(sub).items()):
                if key in _MODULE_TABLES or "_hooks" in key:
                    continue
                found = capture_values_in(value, f"{prefix}.{key}", depth, seen)
                if found:
                    return found
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if isinstance(t, FakeTensor) or isinstance(t.grad, FakeTensor):
                return f"module.{name}" + ("" if isinstance(t, FakeTensor) else ".grad")
    return capture_values_in(args, "args", depth, seen) or \
        capture_values_in(kwargs, "kwargs", depth, seen)
