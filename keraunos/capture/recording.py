"""Recording stand-in classes: during capture, each module (and each plain object the program
reads, a config say) has its class swapped for a subclass whose attribute reads and writes go
through the capture context, so that they become guards and epilogue writes. The real classes are
restored after capture; outside a capture (and in other threads) the stand-ins behave as the
originals."""
from __future__ import annotations

from .state import _active

_recording_classes: dict[tuple[type, str], type] = {}


def _recording_class(cls: type, kind: str) -> type:
    """A subclass of ``cls`` whose attribute reads (and, for modules, writes) go through the
    active capture: ``CaptureContext.module_getattr``/``object_getattr``/``module_setattr``."""
    sub = _recording_classes.get((cls, kind))
    if sub is None:
        read = "module_getattr" if kind == "module" else "object_getattr"

        def __getattribute__(self, name):
            ctx = getattr(_active, "ctx", None)
            if ctx is None or name.startswith("__"):
                return cls.__getattribute__(self, name)
            return getattr(ctx, read)(self, name)

        write = "module_setattr" if kind == "module" else "object_setattr"

        def __setattr__(self, name, value):
            ctx = getattr(_active, "ctx", None)
            if ctx is None:
                return cls.__setattr__(self, name, value)
            getattr(ctx, write)(self, name, value)

        namespace = {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__}
        if kind in ("module", "argument"):
            namespace["__setattr__"] = __setattr__
        sub = _recording_classes[(cls, kind)] = type(cls.__name__, (cls,), namespace)
    return sub


def _recording_module_class(cls: type) -> type:
    return _recording_class(cls, "module")


def _recording_object_class(cls: type) -> type:
    return _recording_class(cls, "object")


def _recording_argument_class(cls: type) -> type:
    """For plain objects passed to the program: reads and writes recorded."""
    return _recording_class(cls, "argument")
