"""Module structure: one token that changes whenever any module's tree may have changed.

The fast prologue (``runtime/fast_prologue.py``) keeps the result of walking a module's tree
(submodules, parameters, buffers, hooks) until this token changes. Only registering a module,
parameter or buffer can change what that walk finds, and PyTorch calls global registration hooks
on every such assignment (``register_module_{module,parameter,buffer}_registration_hook``), so
those hooks replace the token. Adding or removing a forward or backward hook goes through
functions wrapped here to do the same.

The registration hooks do not fire for ``del module.x``, for setting a parameter to ``None``, or
for writes straight into ``module._parameters`` (``_buffers``, ``_modules``), so the walk makes
those tables ``WatchedTable``s, dicts that replace the token when written. Only code that kept a
reference to a table from before the first compile and writes through it goes unseen; call
``keraunos.invalidate_module_structure()`` after such a write.
"""
from __future__ import annotations

import torch

from ..torch_internals import patching


class _Token:
    """A fresh token per change. Not ``object()``: dynamo traces the global registration hook
    into every torch.compile'd forward that builds a module (transformers' ``self.layers[:n]``
    makes a ModuleList) and cannot trace ``object()``, which was a graph break in each such
    forward; a user class it can make, and it replays the store after the graph."""

    __slots__ = ()


# Replaced by a new token whenever a module, parameter or buffer is registered anywhere.
_tree_token: list[object] = [_Token()]


def invalidate_module_structure() -> None:
    """Make every jitted module walk its module tree again on its next call."""
    _tree_token[0] = _Token()


def _on_registration(module, name, value):
    _tree_token[0] = _Token()




# Forward and backward hooks run inside the captured program: adding or removing one must be
# seen. Registering and removing go through these functions, which then invalidate the cached
# walk; the walk compares every module's hooks with those compiled in (``hook_state``).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                "_backward_pre_hooks")
_GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                       "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
                       "_global_backward_hooks", "_global_backward_pre_hooks")
_module_module = torch.nn.modules.module


def _invalidating(register):
    def wrapper(*args, **kwargs):
        _tree_token[0] = _Token()
        return register(*args, **kwargs)
    wrapper.__wrapped__ = register
    wrapper._keraunos_hook_watch = True  # (what the fuzzer's process-state check recognises)
    wrapper.__name__, wrapper.__qualname__ = register.__name__, register.__qualname__
    wrapper.__doc__ = register.__doc__
    return wrapper


_HOOK_REGISTRATION = ("register_forward_pre_hook", "register_forward_hook",
                      "register_backward_hook", "register_full_backward_hook",
                      "register_full_backward_pre_hook")
_GLOBAL_HOOK_REGISTRATION = ("register_module_forward_pre_hook", "register_module_forward_hook",
                             "register_module_backward_hook",
                             "register_module_full_backward_hook",
                             "register_module_full_backward_pre_hook")
_installed: list[bool] = []


def install() -> None:
    """What makes the token change, installed when the first module's tree is walked (a jitted
    module's first call), not when keraunos is imported: torch's global registration hooks
    (public API), and the functions that add and remove forward and backward hooks wrapped to
    change the token first. Once per process; the wrappers call torch's own functions."""
    if _installed:
        return
    _installed.append(True)
    torch.nn.modules.module.register_module_module_registration_hook(_on_registration)
    torch.nn.modules.module.register_module_parameter_registration_hook(_on_registration)
    torch.nn.modules.module.register_module_buffer_registration_hook(_on_registration)
    patching.wrap_for_good(torch.nn.Module, _HOOK_REGISTRATION, _invalidating)
    patching.wrap_for_good(_module_module, _GLOBAL_HOOK_REGISTRATION, _invalidating)
    patching.wrap_for_good(torch.utils.hooks.RemovableHandle, ("remove",), _invalidating)
    _tree_token[0] = _Token()


def hook_state(module: torch.nn.Module) -> tuple:
    """Every hook that calling ``module`` runs, in order: the module tree's and the global ones."""
    tables = [getattr(_module_module, name) for name in _GLOBAL_HOOK_TABLES]
    for sub in module.modules():
        d = sub.__dict__
        tables += [d.get(name) or {} for name in _HOOK_TABLES]
    return tuple(tuple(t.items()) for t in tables)


class WatchedTable(dict):
    """A module's ``_parameters`` / ``_buffers`` / ``_modules`` table that invalidates every cached
    module-structure walk when written to. The registration hooks miss ``del module.x``, setting a
    parameter to ``None`` and direct writes to the table (``functional_call``, say); this sees them.
    Pickles and deep-copies as a plain ``dict``."""

    def __setitem__(self, key, value):
        _tree_token[0] = _Token()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        _tree_token[0] = _Token()
        dict.__delitem__(self, key)

    def pop(self, *args):
        _tree_token[0] = _Token()
        return dict.pop(self, *args)

    def popitem(self):
        _tree_token[0] = _Token()
        return dict.popitem(self)

    def clear(self):
        _tree_token[0] = _Token()
        dict.clear(self)

    def update(self, *args, **kwargs):
        _tree_token[0] = _Token()
        dict.update(self, *args, **kwargs)

    def setdefault(self, key, default=None):
        _tree_token[0] = _Token()
        return dict.setdefault(self, key, default)

    def __ior__(self, other):
        _tree_token[0] = _Token()
        return dict.__ior__(self, other)

    def __reduce__(self):
        return (dict, (dict(self),))

    def __deepcopy__(self, memo):
        import copy
        return {copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()}


def watch_modules(modules) -> None:
    """Make the tables of these modules ``WatchedTable``s (once)."""
    install()
    for m in modules:
        d = m.__dict__
        for name in ("_parameters", "_buffers", "_modules"):
            table = d.get(name)
            if table is not None and type(table) is dict:
                d[name] = WatchedTable(table)
