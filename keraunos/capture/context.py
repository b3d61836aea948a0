"""The capture context: runs the user's program once on fake tensors and records what it does.

Three things are recorded at once:
- every torch call (through a ``TorchFunctionMode``), as a bound symbol on proxies;
- every value the program read from its inputs, module tree and globals, as a guard;
- every write the program made to a tensor input (in-place ops) or to a module attribute.

Fake tensors (``FakeTensorMode``) give every op with a meta kernel exact shape,
dtype, device and stride semantics without running it; one fake mode per capture, so inputs that
share storage become fakes that share storage.

``CaptureContext`` is made of parts, each in its own module and each initialising its own state:
- ``inputs.InputsMixin``: tensor and value inputs, their provenance, the module tree's paths;
- ``reads.ReadsMixin``: module and object attribute reads and writes, the recording classes;
- ``calls.CallsMixin``: the torch calls recorded as lines, in-place writes, grad-mode switches;
- ``data.DataSpecialization`` (``ctx.data``): values read from tensor data;
- ``scopes.ScopeGuards`` (``ctx.scopes``): the globals and closures of the program's functions;
- ``dtensor.DTensorState`` (``ctx.dtensors``): the program's DTensors and their stand-ins.
The first three are mixins, because their methods share the context's state and are called by
name (the recording classes call ``module_getattr``, ...); the others own their state and are
reached through the forwarding methods below, or directly. This module keeps what they all
share: the fake mode, the size symbols, the names, the guards, and the objects at the root of
paths.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..torch_internals.fake import FakeTensorMode, ShapeEnv
from ..core.provenance import Path
from ..core.proxies import NameGenerator
from .calls import CallsMixin
from .data import DataSpecialization
from .dtensor import DTensorState
from .guards import Guard, GuardKind
from .inputs import InputsMixin
from .reads import ReadsMixin
from .scopes import ScopeGuards
from .symbolic import DynamicRequest, Symbols


class CaptureContext(InputsMixin, ReadsMixin, CallsMixin):
    """One capture of one program: its parts are listed in the module's docstring."""

    def __init__(self, names: NameGenerator, module: torch.nn.Module | None,
                 fn: Callable | None, dynamic: DynamicRequest | None = None):
        self.names = names
        # A shape environment lets ops whose output shape depends on data (torch.where(mask),
        # nonzero, boolean indexing) produce fakes of unknown size; Python decisions on such a size
        # still fail, as a CaptureError. Fakes are static unless ``dynamic`` asks for symbolic
        # sizes (see symbolic.py); each input dimension then gets a symbol of its own (no duck
        # sizing: equal sizes are only tied together when the program relies on it).
        self.fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=dynamic is None),
                                        static_shapes=True)
        self.dynamic = dynamic
        self.symbols = Symbols(self.fake_mode, names) if dynamic is not None else None
        self.guards: list[Guard] = []
        self._guarded: set = set()
        self.specialize_data = False  # set by capture_program: jit(..., specialize_data=True)
        # What ``torch.compiler.is_compiling()`` says during capture (capture_program).
        self.as_compiler = True
        self.dtensors = DTensorState()  # the program's DTensors (dtensor.py)
        # The Python function whose globals and closure the program reads.
        self.fn = _python_function(type(module).forward if module is not None else fn)
        self.root_module = module
        self.arg_names = _positional_names(module.forward if module is not None else fn)
        # Objects at the root of paths that start neither at the call nor at the module.
        self.root_objects: dict[str, Any] = {}
        self._init_calls(module)
        self._init_reads()
        self._init_inputs(module)
        self.data = DataSpecialization(self)
        self.scopes = ScopeGuards(self.fn, self.root_objects, self.guard, self.watch_scope_object)
        self._target = fn  # as jitted: a bound method's object is read as ``self``
        # The scope guards' state under the names the interceptors and capture_program use.
        self.helper_codes = self.scopes.helper_codes
        self.scope_containers = self.scopes.containers

    def guard(self, kind: GuardKind, path: Path | None, expected: Any,
              expression: str | None = None):
        """Record a check the prologue makes on every call (once per kind, path, expression)."""
        key = (kind, path, expression)
        if key in self._guarded:
            return
        self._guarded.add(key)
        from_module = path is not None and path.is_module_derived()
        self.guards.append(Guard(kind, path, expected, expression, from_module))

    def specialize_on_data(self, symbol, func, args, kwargs):
        """A Python value read from tensor data: see ``DataSpecialization.specialize``."""
        return self.data.specialize(symbol, func, args, kwargs)

    def guard_function_scope(self) -> None:
        """Guard the jitted function's globals and closure, and a bound method's object: see
        ``ScopeGuards``."""
        self.scopes.guard_function_scope()
        if self.root_module is None:
            self.scopes.guard_bound_self(self._target)

    def guard_helper_scope(self, frame) -> None:
        """Guard the globals and closure of a function the program called: see ``ScopeGuards``."""
        self.scopes.guard_helper_scope(frame)


def _python_function(fn):
    fn = getattr(fn, "__func__", fn)
    return fn if hasattr(fn, "__code__") else getattr(type(fn), "__call__", None)


def _positional_names(fn) -> dict[int, str]:
    """Position -> parameter name, so that traces say ``x`` rather than ``args_0``."""
    import inspect
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {i: p.name for i, p in enumerate(params)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
