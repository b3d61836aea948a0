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

from dataclasses import dataclass

from .state import _active


@dataclass(frozen=True)
class Recorded:
    """What a kind of stand-in records: the ``CaptureContext`` method its attribute reads go
    through, the one its writes go through (``None``: writes are the real class's own), and
    whether copying, pickling or ``vars()`` count as a read of every attribute (modules are
    walked by their tables instead)."""

    name: str
    read: str
    write: str | None
    whole_state_read: bool


MODULE = Recorded("module", "module_getattr", "module_setattr", whole_state_read=False)
OBJECT = Recorded("object", "object_getattr", "held_object_setattr",  # a config, say
                  whole_state_read=True)
ARGUMENT = Recorded("argument", "object_getattr", "object_setattr", whole_state_read=True)
# An object the program reaches by name (a global, a closure variable, a bound method's self):
# reads are guarded; a write is undone after capture, which then takes the fallback route.
SCOPE = Recorded("scope object", "object_getattr", "scope_object_setattr", whole_state_read=True)

_recording_classes: dict[tuple[type, Recorded], type] = {}

ORIGINAL = "_keraunos_original_class"  # on a stand-in class: the class it stands in for


def original_class(obj) -> type:
    """The real class of ``obj``, also while it wears a recording stand-in."""
    cls = type(obj)
    return cls.__dict__.get(ORIGINAL, cls)


def _recording_class(cls: type, recorded: Recorded) -> type:
    """A subclass of ``cls`` whose attribute reads (and writes, where ``recorded`` names a method
    for them) go through the active capture's methods ``recorded`` names."""
    sub = _recording_classes.get((cls, recorded))
    if sub is None:
        read, write, whole_state_read = recorded.read, recorded.write, recorded.whole_state_read

        def __getattribute__(self, name):
            ctx = getattr(_active, "ctx", None)
            if ctx is None or name.startswith("__"):
                if whole_state_read and name == "__class__":
                    return cls  # what pickle checks a reduction against
                if whole_state_read and name == "__dict__" and ctx is not None:
                    ctx.object_state_read(self)  # vars(obj), obj.__dict__: all of it is read
                return cls.__getattribute__(self, name)
            return getattr(ctx, read)(self, name)

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
        if write is not None:
            namespace["__setattr__"] = __setattr__
        if whole_state_read:
            namespace["__reduce_ex__"] = __reduce_ex__
        sub = _recording_classes[(cls, recorded)] = type(cls.__name__, (cls,), namespace)
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
    return _recording_class(cls, MODULE)


def _recording_object_class(cls: type) -> type:
    return _recording_class(cls, OBJECT)


def _recording_argument_class(cls: type) -> type:
    """For plain objects passed to the program: reads and writes recorded."""
    return _recording_class(cls, ARGUMENT)


def _recording_scope_class(cls: type) -> type:
    """For objects the program reaches by name: reads recorded, writes remembered to undo."""
    return _recording_class(cls, SCOPE)
