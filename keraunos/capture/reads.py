"""The reads part of the capture context: the program's reads and writes of module attributes
and of plain objects' attributes.

It owns what capture knows of the objects it watches: the recording classes swapped in (and
restored after capture), the path of each watched object, which of them came with the call
(their writes are replayed by the epilogue), the overlay of values the program wrote (seen by
its later reads), the writes themselves (``attribute_writes``), and the caches a torch module
derives from its parameters (``_DERIVED_CACHES``), read as forward rebuilds them.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..torch_internals.dispatch import DisableTorchFunction
from ..torch_internals.fake import FakeTensor
from ..core.provenance import ATTR, BUFFER, CALL, PARAMETER, SUBMODULE, Path, root
from ..core.tags import STATIC_MEMORY_LOCATION
from ..errors import (CaptureError, LazyStateError, UnguardableStateError,
                      UnsupportedInputError, is_stdlib, user_source)
from . import guards, schedulers
from .dtensor import is_device_mesh
from .guards import is_plain
from .recording import (_recording_argument_class, _recording_module_class,
                        _recording_object_class, _recording_scope_class, original_class)


@dataclass
class AttributeWrite:
    """``module.name = value`` done by the program; replayed by the epilogue."""

    module_path: Path
    name: str
    value: Any  # a fake tensor or a plain Python value


class ReadsMixin:
    """Module and object attribute reads and writes, called by the recording classes
    (``recording.Recorded`` names these methods). Part of ``CaptureContext``: it uses the
    context's ``guard`` and ``root_objects``, and the inputs part's ``tensor_input``,
    ``value_input``, ``real_tensor_reached_program``, ``module_paths`` and ``tree_modules``."""

    def _init_reads(self) -> None:
        self.attribute_writes: list[AttributeWrite] = []
        self._overlay: dict[int, dict[str, Any]] = {}
        # The stand-in of each list or dict a tree module holds, by (module id, name): every read
        # of the attribute gets the one stand-in, so the program sees its own writes to it.
        self._held_containers: dict[tuple[int, str], Any] = {}
        self.argument_objects: set[int] = set()  # ids of plain objects passed in (writable)
        self._swapped: list[tuple[Any, type]] = []
        self._object_paths: dict[int, Path] = {}
        self.scope_objects: set[int] = set()  # ids of objects reached by name (see watch_scope_object)
        self.unguardable_reads: list[str] = []  # what of theirs could not be checked
        # Attributes the program set on those objects: (object, name, value before or _ABSENT).
        self._scope_writes: dict[tuple[int, str], tuple[Any, str, Any]] = {}
        # Whether every attribute the program set on those objects is new, with a plain value
        # (state made on a first call: ``LazyStateError``).
        self.scope_attributes_only_added = True

    def module_path(self, module) -> Path:
        path = self.module_paths.get(id(module))
        if path is None:  # a module created during the program: treat as a captured constant
            key = f"<module {type(module).__name__} {id(module):#x}>"
            self.root_objects[key] = module
            path = self.module_paths[id(module)] = root(key)
        self.guard(guards.TYPE, path, original_class(module))
        return path

    def module_getattr(self, module, name: str) -> Any:
        d = object.__getattribute__(module, "__dict__")
        if "_parameters" not in d or id(module) not in self.tree_modules:
            # A module the program made (a ModuleList slice of the tree's modules, say): a
            # temporary whose reads are not state; the tree modules it holds are watched.
            return object.__getattribute__(module, name)
        overlay = self._overlay.get(id(module))
        if overlay is not None and name in overlay:
            return overlay[name]
        derive = _derived_cache(module, name)
        if derive is not None:
            return derive(self, module)
        mpath = self.module_path(module)
        for kind, table in ((PARAMETER, d["_parameters"]), (BUFFER, d["_buffers"])):
            if name in table:
                value = table[name]
                path = Path(mpath, kind, name)
                if value is None:
                    self.guard(guards.VALUE, path, None)
                    return None
                return self.tensor_input(value, path, (STATIC_MEMORY_LOCATION,))
        if name in d["_modules"]:
            sub = d["_modules"][name]
            path = Path(mpath, SUBMODULE, name)
            if sub is None:
                self.guard(guards.VALUE, path, None)
            elif self.module_paths.get(id(sub)) != path:
                self.guard(guards.IDENTITY, path, sub)
            return sub
        if name in d and name not in MODULE_INTERNALS:
            if type(d[name]) not in (list, dict):
                return self.value_input(d[name], Path(mpath, ATTR, name))
            key = (id(module), name)
            if key not in self._held_containers:
                self._held_containers[key] = self.value_input(d[name], Path(mpath, ATTR, name))
            return self._held_containers[key]
        if name in ("_modules", "_parameters", "_buffers"):
            # The program looks at the whole table (iterating a ModuleList, say): its keys matter.
            self.guard(guards.KEYS, Path(mpath, ATTR, name), (dict, tuple(d[name])))
        try:
            return object.__getattribute__(module, name)
        except AttributeError:
            # `getattr(self, "extra", None)`: the program depends on the attribute's absence.
            self.guard(guards.ABSENT, Path(mpath, ATTR, name), None)
            raise

    def module_setattr(self, module, name: str, value: Any) -> None:
        if id(module) not in self.tree_modules:  # created by the program: an ordinary write
            original_class(module).__setattr__(module, name, value)
            return
        if _derived_cache(module, name) is not None:
            self._overlay.setdefault(id(module), {})[name] = value  # seen by later reads only
            return
        self._deferred_write(module, self.module_path(module), name, value, "modules")

    def _watch_object(self, obj: Any, path: Path, writable: bool = False,
                      scope: bool = False) -> bool:
        """Swap in a recording class; whether ``obj`` is watched (at ``path``) afterwards.
        ``writable``: the object came with the call, so the program's writes to it are recorded
        and replayed by the epilogue rather than made to the object during capture. ``scope``:
        the program reaches it by name (``watch_scope_object``)."""
        if id(obj) in self._object_paths or isinstance(obj, torch.nn.Module):
            return self._object_paths.get(id(obj)) == path
        cls = original_class(obj)
        if not hasattr(obj, "__dict__") or cls.__module__ == "builtins" or isinstance(obj, type) \
                or callable(obj):
            return False
        stand_in = (_recording_argument_class if writable else
                    _recording_scope_class if scope else _recording_object_class)
        try:
            obj.__class__ = stand_in(cls)
        except (TypeError, AttributeError, dataclasses.FrozenInstanceError):
            return False  # a class that cannot be swapped (a frozen dataclass's own check)
        self._object_paths[id(obj)] = path
        self._swapped.append((obj, cls))
        if writable:
            self.argument_objects.add(id(obj))
        if scope:
            self.scope_objects.add(id(obj))
        return True

    def watch_scope_object(self, obj: Any, path: Path) -> None:
        """An object the program reaches by name, at ``path``: a global or closure variable of
        the function or of a helper it calls, or the object of a jitted bound method. Capture
        would otherwise read its attributes unseen and bake them in (``x * cfg.scale`` after
        ``cfg.scale = 3.0`` must recompile): it must stay the same object, each attribute the
        program reads is guarded, the plain lists and dicts it holds are watched like the
        globals' own (changed: undone, and the fallback route), and an attribute the program sets
        on it is undone after capture with the same outcome. Objects of the standard library (a
        logger, a lock) are left alone."""
        if isinstance(obj, (types.ModuleType, type)) or _made_by_the_program(obj):
            # A module (``torch.ops.aten``, a lazy module) caches attributes on first access:
            # watched, that would count as a change. Modules and classes are the code's, not data.
            return
        known = self._object_paths.get(id(obj))
        if known is not None:
            if known != path:  # also an argument, say: the compiled program reads this very one
                self.guard(guards.IDENTITY, path, obj)
                self.guard(guards.IDENTITY, known, obj)
            return
        # The same object at least (a function, a partial, a frozen dataclass, a logger), and
        # when it can be watched, each attribute the program reads.
        self.guard(guards.IDENTITY, path, obj)
        if type(obj) is weakref.ref:
            # The program reaches what it refers to by calling it: watched as found by name (an
            # LR scheduler's wrapper of ``optimizer.step`` holds the optimizer so).
            referent = obj()
            if referent is not None and not isinstance(referent, torch.Tensor):
                self.watch_scope_object(referent, Path(path, CALL, None))
            return
        if _user_object(obj) and not is_device_mesh(obj):  # a mesh's state is torch's
            self._watch_object(obj, path, scope=True)

    def held_object_setattr(self, obj, name: str, value: Any) -> None:
        """``obj.name = value`` on an object the module holds (a config: Hugging Face's models
        set ``config.problem_type`` on their first loss): seen by the program's later reads,
        replayed by the epilogue on every call, and not made during capture, so that the object
        is as the call found it when the prologue's checks of it are first run."""
        if id(obj) not in self._object_paths:  # made by the program: an ordinary write
            original_class(obj).__setattr__(obj, name, value)
            return
        self._deferred_write(obj, self._object_paths[id(obj)], name, value,
                             "objects the module holds")

    def _deferred_write(self, obj, path: Path, name: str, value: Any, what: str) -> None:
        """A write the program's later reads see (the overlay) and the epilogue replays on every
        call; only tensors and plain values can be replayed."""
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self.real_tensor_reached_program(value)
        if isinstance(value, torch.nn.Module) and what == "modules":
            # A module the program puts in the tree (BigBird swaps its attention for the
            # full one when a sequence is too short for blocks): the tree changes once.
            raise LazyStateError(
                f"keraunos cannot capture this call as one trace: it sets {path}.{name} to a "
                f"{type(value).__qualname__} at {user_source()}, which changes the module tree."
                f"\n  keraunos.jit runs this call eagerly, which makes the change, and captures "
                f"the next call, which runs on the new tree.")
        if not (isinstance(value, FakeTensor) or is_plain(value)):
            raise CaptureError(
                f"keraunos: the program sets {path}.{name} to a {type(value).__qualname__} at "
                f"{user_source()}; only tensors and plain Python values can be written to {what} "
                f"inside a jitted forward. Move the assignment out of forward.")
        self._overlay.setdefault(id(obj), {})[name] = value
        self.attribute_writes.append(AttributeWrite(path, name, value))

    def scope_object_setattr(self, obj, name: str, value: Any) -> None:
        """``obj.name = value`` on an object reached by name: made (the rest of the program reads
        it), and remembered so that it is undone after capture (``undo_scope_writes``)."""
        if schedulers.replayed_flag(obj, name, value):
            self._deferred_write(obj, self._object_paths[id(obj)], name, value, "optimizers")
            return
        d = object.__getattribute__(obj, "__dict__")
        self._scope_writes.setdefault((id(obj), name), (obj, name, d.get(name, _ABSENT)))
        original_class(obj).__setattr__(obj, name, value)
        self._overlay.setdefault(id(obj), {})[name] = value  # what later reads see

    def undo_scope_writes(self) -> list[str]:
        """Put back every attribute the program set on an object reached by name; what was
        set, in words (``ScopeContainers.undo_changes``'s form)."""
        changed = []
        self.scope_attributes_only_added = True
        for obj, name, before in reversed(self._scope_writes.values()):
            d = object.__getattribute__(obj, "__dict__")
            if d.get(name, _ABSENT) is before:
                continue  # set and put back by the program itself (a context variable's reset)
            self.scope_attributes_only_added &= before is _ABSENT and is_plain(d.get(name))
            if before is _ABSENT:
                d.pop(name, None)
            else:
                d[name] = before
            changed.append(f"the attribute {name!r} of {self._object_paths[id(obj)]} "
                           f"({original_class(obj).__qualname__})")
        self._scope_writes.clear()
        return changed

    def object_setattr(self, obj, name: str, value: Any) -> None:
        """``obj.name = value`` on an object passed in: seen by later reads, replayed by the
        epilogue (``cache.keys = t5``)."""
        if id(obj) not in self.argument_objects:
            original_class(obj).__setattr__(obj, name, value)
            return
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self.real_tensor_reached_program(value)
        self._overlay.setdefault(id(obj), {})[name] = value
        self.attribute_writes.append(AttributeWrite(self._object_paths[id(obj)], name, value))

    def object_getattr(self, obj, name: str) -> Any:
        d = object.__getattribute__(obj, "__dict__")
        cls = original_class(obj)
        if id(obj) not in self._object_paths:
            # Made by the program from a watched object (``type(self)(...)`` in a class's own
            # ``__copy__``): what it holds came from reads already recorded.
            return cls.__getattribute__(obj, name)
        if id(obj) in self.stepped_schedulers:
            return schedulers.read_after_step(self, obj, name,
                                              lambda: self._object_getattr(obj, d, cls, name))
        if name == "step" and schedulers.is_scheduler(obj):  # made after the computation
            return schedulers.deferred_step(self, obj, self._object_paths[id(obj)])
        return self._object_getattr(obj, d, cls, name)

    def _object_getattr(self, obj, d: dict, cls: type, name: str) -> Any:
        if id(obj) in self.argument_objects:
            return self._argument_getattr(obj, d, cls, name)
        if id(obj) in self.scope_objects:
            return self._scope_getattr(obj, d, cls, name)
        written = self._overlay.get(id(obj))
        if written and name in written:
            return written[name]  # set by the program (held_object_setattr)
        if cls.__getattribute__ is not object.__getattribute__:
            # The object resolves names itself (a config's attribute_map, say): read through it.
            value = cls.__getattribute__(obj, name)
            if name in d or is_plain(value):
                return self.value_input(value, Path(self._object_paths[id(obj)], ATTR, name))
            return value
        if name in d:
            return self.value_input(d[name], Path(self._object_paths[id(obj)], ATTR, name))
        return object.__getattribute__(obj, name)

    def _scope_getattr(self, obj, d: dict, cls: type, name: str) -> Any:
        """A read of an object found by name: taken in once (a later read gets what the first
        got, or what the program set since), a plain list or dict it holds watched."""
        overlay = self._overlay.setdefault(id(obj), {})
        if name in overlay:
            return overlay[name]
        path = self._object_paths[id(obj)]
        where = Path(path, ATTR, name)
        try:
            raw = cls.__getattribute__(obj, name)  # the class's own resolution (attribute maps)
        except AttributeError:
            self.guard(guards.ABSENT_ATTRIBUTE, where, None)  # getattr(cfg, "flag", False)
            raise
        if name not in d and not is_plain(raw):
            return raw  # a method or function of its class: the class is the object's own
        try:
            # Taken in inside the program: the recording mode must not see the metadata reads
            # of taking a tensor in (it would count as reached from nowhere).
            with DisableTorchFunction():
                value = overlay[name] = self.value_input(raw, where)  # a class attribute too
        except UnsupportedInputError as e:
            # Remembered as well as raised: a program that catches the error must not leave
            # the read unchecked (``refuse_unguardable_reads``, after capture).
            self.unguardable_reads.append(
                f"keraunos cannot capture {user_source()}\n  it reads {path}.{name}, a "
                f"{type(raw).__qualname__} held by an object it finds by name, which "
                f"keraunos cannot check on later calls ({e}).\n  What to do: "
                f"keraunos.jit(..., fallback=\"dynamo\") (the default) runs it through "
                f"torch.compile(backend=\"keraunos\"), which guards such reads; or pass what "
                f"the program reads as arguments.")
            raise UnguardableStateError(self.unguardable_reads[-1]) from None
        if value is d.get(name):  # the object's own value: a plain list or dict, say
            self.scope_containers.watch(f"{path}.{name} (an attribute of a {cls.__qualname__})",
                                        value)
        return value

    def object_state_read(self, obj) -> None:
        """The program reads the whole state of a watched object at once: it copies or pickles
        it, or reads its ``__dict__`` (a config's ``to_dict()``). Every attribute counts as read,
        so the copy's values are guarded like the original's; nested objects become watched
        here, and a deep copy reads their state in turn."""
        path = self._object_paths.get(id(obj))
        if path is None:
            return  # made by the program: its state came from reads already recorded
        d = object.__getattribute__(obj, "__dict__")
        cls = original_class(obj)
        if id(obj) in self.scope_objects:
            for name in list(d):
                self._scope_getattr(obj, d, cls, name)
            if self._overlay.get(id(obj), {}).keys() - d.keys() or any(
                    self._overlay[id(obj)][k] is not d[k] for k in self._overlay.get(id(obj), {})
                    if k in d and not isinstance(d[k], (list, dict, tuple))):
                raise CaptureError(_whole_state_after_write(path, cls))
            return
        if id(obj) not in self.argument_objects:
            if any(k in self._overlay.get(id(obj), ()) for k in d) or \
                    self._overlay.get(id(obj), {}).keys() - d.keys():
                # set by the program (held_object_setattr): a copy made now would not see it
                raise CaptureError(_whole_state_after_write(path, cls))
            for name in list(d):
                self.value_input(d[name], Path(path, ATTR, name))
            return
        for name in list(d) + [k for k in self._overlay.get(id(obj), ()) if k not in d]:
            if self._argument_getattr(obj, d, cls, name) is not d.get(name):
                raise CaptureError(
                    f"keraunos: the program copies or pickles {path}, a {cls.__qualname__} "
                    f"passed in, at {user_source()}; its attribute {name!r} holds a tensor, a "
                    f"list or a dict, or was set by the program, which a copy made during "
                    f"capture would not see as the call passes it. Copy the object before "
                    f"calling the jitted function, or pass what the copy needs instead.")

    def _argument_getattr(self, obj, d: dict, cls: type, name: str) -> Any:
        overlay = self._overlay.setdefault(id(obj), {})
        if name in overlay:  # written by the program, or read before (one stand-in per list)
            return overlay[name]
        if cls.__getattribute__ is not object.__getattribute__:
            raise UnsupportedInputError(
                f"keraunos.jit: {self._object_paths[id(obj)]} is a {cls.__qualname__}, which "
                f"resolves attributes itself; keraunos cannot record what the program reads.")
        if name in d:
            # Read inside the program: the recording mode must not see the metadata reads of
            # taking the value in (a real tensor would count as reached from nowhere).
            with DisableTorchFunction():
                value = self.value_input(d[name], Path(self._object_paths[id(obj)], ATTR, name))
            overlay[name] = value
            return value
        try:
            return object.__getattribute__(obj, name)  # methods, class attributes: type checked
        except AttributeError:
            self.guard(guards.ABSENT_ATTRIBUTE, Path(self._object_paths[id(obj)], ATTR, name), None)
            raise

    def swap_module_classes(self, module: torch.nn.Module) -> None:
        for sub in module.modules():
            cls = type(sub)
            sub.__class__ = _recording_module_class(cls)
            self._swapped.append((sub, cls))

    def restore_classes(self) -> None:
        for obj, cls in reversed(self._swapped):
            obj.__class__ = cls
        self._swapped.clear()


_ABSENT = object()  # an attribute an object did not have before the program set it


def _whole_state_after_write(path, cls) -> str:
    return (f"keraunos: the program copies, pickles or reads the __dict__ of {path}, a "
            f"{cls.__qualname__}, at {user_source()}, after setting one of its attributes; a "
            f"copy made during capture would not hold what the program set. Copy the object "
            f"before setting the attribute, or outside the jitted function.")


def _user_object(obj) -> bool:
    """Whether ``obj`` is the program's data rather than the standard library's machinery (a
    logger, a lock, a thread-local), which it only calls."""
    module = sys.modules.get(original_class(obj).__module__)
    filename = getattr(module, "__file__", None)
    return not (filename and is_stdlib(filename))


def _made_by_the_program(obj) -> bool:
    """An object holding capture's fake tensors was made by the program (a helper's global
    assigned during capture): what it holds comes from reads already recorded."""
    d = getattr(obj, "__dict__", None)
    return isinstance(d, dict) and any(isinstance(v, FakeTensor) for v in d.values())


def _rnn_flat_weights(ctx: ReadsMixin, module: torch.nn.RNNBase) -> list:
    """``_flat_weights`` as ``RNNBase.forward`` leaves it once ``_update_flat_weights`` ran: the
    parameters named in ``_flat_weights_names`` (``None`` for one the module lacks)."""
    weights = []
    for name in ctx.module_getattr(module, "_flat_weights_names"):
        try:
            weights.append(ctx.module_getattr(module, name))
        except AttributeError:
            weights.append(None)
    return weights


def _rnn_flat_weight_refs(ctx: ReadsMixin, module: torch.nn.RNNBase) -> list:
    """Weak references to those weights, by which forward tells that none was replaced."""
    return [None if w is None else weakref.ref(w) for w in _rnn_flat_weights(ctx, module)]


# Attributes a torch module keeps as a cache of its own parameters, and rebuilds inside forward
# when a parameter was replaced: capture reads them as forward finds them after rebuilding, made
# of the parameters it reads (each an input with its checks), so every call uses the parameters
# it passes, as eager does. Writes of them stay within the capture: the real module's cache
# heals itself the same way on its next eager call. (nn.LSTM, nn.GRU, nn.RNN: their forward
# compares ``_flat_weight_refs`` with the parameters, which capture sees as stand-ins, and would
# otherwise rebuild ``_flat_weights`` on every capture.)
_DERIVED_CACHES: dict[tuple[type, str], Callable] = {
    (torch.nn.RNNBase, "_flat_weights"): _rnn_flat_weights,
    (torch.nn.RNNBase, "_flat_weight_refs"): _rnn_flat_weight_refs,
}


def _derived_cache(module, name: str) -> Callable | None:
    for (cls, attribute), derive in _DERIVED_CACHES.items():
        if name == attribute and isinstance(module, cls):
            return derive
    return None


MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_compiled_call_impl", "forward", "call_super_init",
    "dump_patches", "_version",
})
