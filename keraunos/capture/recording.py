"""Recording stand-in classes: during capture, each module (and each plain object the program
reads, a config say) has its class swapped for a subclass whose attribute reads and writes go
through the capture context, so that they become guards and epilogue writes. The real classes are
restored after capture; outside a capture (and in other threads) the stand-ins behave as the
originals."""
from __future__ import annotations

from .state import _active

_recording_classes: dict[type, type] = {}

def _recording_module_class(cls: type) -> type:
    """A subclass of ``cls`` whose attribute reads and writes go through the active capture."""
    sub = _recording_classes.get(cls)
    if sub is None:
        def __getattribute__(self, name):
            ctx = getattr(_active, "ctx", None)
            if ctx is None or name.startswith("__"):
                return cls.__getattribute__(self, name)
            return ctx.module_getattr(self, name)

        def __setattr__(self, name, value):
            ctx = getattr(_active, "ctx", None)
            if ctx is None:
                return cls.__setattr__(self, name, value)
            ctx.module_setattr(self, name, value)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                          "__setattr__": __setattr__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _recording_classes[cls] = sub
    return sub


def _recording_object_class(cls: type) -> type:
    sub = _recording_classes.get(cls)
    if sub is None:
        def __getattribute__(self, name):
            ctx = getattr(_active, "ctx", None)
            if ctx is None or name.startswith("__"):
                return cls.__getattribute__(self, name)
            return ctx.object_getattr(self, name)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _recording_classes[cls] = sub
    return sub
