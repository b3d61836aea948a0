"""Recording stand-in classes: during capture, each module (and each plain object the program
reads, a config say) has its class swapped for a subclass whose attribute reads and writes go
through the capture context, so that they become guards and epilogue writes. The real classes are
restored after capture; outside a capture (and in other threads) the stand-ins behave as the
originals.

A stand-in must never show through. Copying or pickling an object (``copy.copy``,
``copy.deepcopy``, ``pickle``, a config's ``to_dict()``) reads its whole state at once, behind
the attribute hooks: the stand-in counts that as a read of every attribute, and reduces the
object as its real class would, so that a copy is an object of the real class."""
from __future__ import annotations

from .state import _active

_recording_classes: dict[tuple[type, str], type] = {}

ORIGINAL = "_keraunos_original_class"  # on a stand-in class: the class it stands in for


def original_class(obj) -> type:
    """The real class of ``obj``, also while it wears a recording stand-in."""
    cls = type(obj)
    return cls.__dict__.get(ORIGINAL, cls)


def _recording_class(cls: type, kind: str) -> type:
    """A subclass of ``cls`` whose attribute reads (and, for modules, writes) go through the
    active capture: ``CaptureContext.module_getattr``/``object_getattr``/``module_setattr``."""
    sub = _recording_classes.get((cls, kind))
    if sub is None:
        read = "module_getattr" if kind == "module" else "object_getattr"
        whole_state_read = kind != "module"  # modules are walked by their tables instead

        def __getattribute__(self, name):
            ctx = getattr(_active, "ctx", None)
            if ctx is None or name.startswith("__"):
                if whole_state_read and name == "__class__":
                    return cls  # what pickle checks a reduction against
                if whole_state_read and name == "__dict__" and ctx is not None:
                    ctx.object_state_read(self)  # vars(obj), obj.__dict__: all of it is read
                return cls.__getattribute__(self, name)
            return getattr(ctx, read)(self, name)

        write = "module_setattr" if kind == "module" else "object_setattr"

        def __setattr__(self, name, value):
            ctx = getattr(_active, "ctx", None)
            if ctx is None:
                return cls.__setattr__(self, name, value)
            getattr(ctx, write)(self, name, value)

        def __reduce_ex__(self, protocol):
            # copy, deepcopy and pickle all start here (unless the class defines __copy__ or
            # __deepcopy__, whose reads of the state go through the hooks above).
            ctx = getattr(_active, "ctx", None)
            if ctx is not None:
                ctx.object_state_read(self)
            return _reduce_as(self, cls, sub, protocol)

        namespace = {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__, ORIGINAL: cls}
        if kind in ("module", "argument"):
            namespace["__setattr__"] = __setattr__
        if whole_state_read:
            namespace["__reduce_ex__"] = __reduce_ex__
        sub = _recording_classes[(cls, kind)] = type(cls.__name__, (cls,), namespace)
    return sub


def _reduce_as(obj, cls: type, stand_in: type, protocol: int):
    """``obj.__reduce_ex__(protocol)`` as ``cls`` gives it: the reduction names the class, and
    copies and unpickled objects are made of what it names, so it must be the real one."""
    object.__setattr__(obj, "__class__", cls)
    try:
        return obj.__reduce_ex__(protocol)
    finally:
        object.__setattr__(obj, "__class__", stand_in)


def _recording_module_class(cls: type) -> type:
    return _recording_class(cls, "module")


def _recording_object_class(cls: type) -> type:
    return _recording_class(cls, "object")


def _recording_argument_class(cls: type) -> type:
    """For plain objects passed to the program: reads and writes recorded."""
    return _recording_class(cls, "argument")
