"""Where the live objects a kept program refers to are (``program_store``): in the capturing
process, a persistent name for each (its path in the module tree, a closure cell by its function
and place, a module global by its module and name, an identity-checked object by its place and
the digest of its contents), and, in a loading process, the object of that name there
(``resolve``). Split from the store along its seam: how objects are found again, not what the
key covers or how rows are kept."""
from __future__ import annotations

import enum
import gc
import importlib
import pickle
import sys
import types

import torch

from ..capture.scopes import GlobalsOf
from . import fingerprint as program_fingerprint
from .fingerprint import _SIMPLE, Unstorable


def keraunos_singletons() -> dict[int, tuple]:
    """keraunos's module-level objects (glue symbols, path and guard kinds, tags), which code
    compares by identity (``b.symbol is glue.CHECK_TENSOR``): kept by module and name."""
    found: dict[int, tuple] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "keraunos" or name.startswith("keraunos.")):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, (*_SIMPLE, types.ModuleType, type, types.FunctionType)):
                continue
            if getattr(type(value), "__module__", "").startswith("keraunos."):
                found.setdefault(id(value), ("singleton", name, attribute))
    return found


_VALUES = (*_SIMPLE, tuple, frozenset, enum.Enum, torch.dtype, torch.device, torch.layout,
           torch.memory_format, torch.Tensor, torch.nn.Module, types.FunctionType, type)


def paths_of(root) -> dict[int, tuple]:
    """The live objects a trace may refer to, by id: a jitted function, its globals, its
    closure and cells, and the module trees its closure cells and globals hold (a function
    closing over a model); or the module tree, its parameters and buffers, and the objects its
    modules hold in attributes (a config object)."""
    if isinstance(root, torch.nn.Module):
        return _module_paths(root)
    paths = {id(root): ("function", ""), id(root.__globals__): ("function globals", "")}
    held = []
    if root.__closure__ is not None:
        paths[id(root.__closure__)] = ("closure", "")
        for i, cell in enumerate(root.__closure__):
            paths[id(cell)] = ("cell", i)
            contents = contents_of(cell)
            if contents and isinstance(contents[0], torch.nn.Module):
                held.append((("cell", i), contents[0]))
    held += [(("global", name), value) for name, value in root.__globals__.items()
             if isinstance(value, torch.nn.Module)]
    for place, module in held:
        for obj, pid in _module_paths(module).items():
            paths.setdefault(obj, ("within", place, pid))
    return paths


def _module_paths(module: torch.nn.Module) -> dict[int, tuple]:
    paths = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), ("module", name))
        for attribute, value in vars(sub).items():
            # Only objects whose identity is theirs: a value (a tuple, a number, a dtype) may be
            # the very object a trace holds for another reason (``()`` is one object).
            if attribute.startswith("_"):
                continue
            if type(value) is torch.Tensor or not isinstance(value, _VALUES):
                # A tensor kept in a plain attribute (litgpt's ``mask_cache``) is an input at
                # that path, as a buffer is: the loading module's own tensor there.
                paths.setdefault(id(value), ("attribute", name, attribute))
    for name, p in module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), ("parameter", name))
    for name, b in module.named_buffers(remove_duplicate=False):
        paths.setdefault(id(b), ("buffer", name))
    for cell, place in _method_cells(module).items():
        paths.setdefault(cell, place)
    return paths


def _method_cells(module: torch.nn.Module) -> dict[int, tuple]:
    """The closure cells of the functions a program of ``module`` may call, where another
    process finds them again: the module tree's methods and the functions in the globals of
    their classes' modules, and the wrappers decorators put around them (transformers'
    ``deprecate_kwarg`` around ``forward`` or ``create_causal_mask`` holds its arguments in
    cells, which the prologue checks). Each by its class and member, or its function's module
    and qualified name, and its place in the wrappers, so that a load reads the loading
    process's cell (whose contents the prologue checks, as after a capture)."""
    cells: dict[int, tuple] = {}
    classes = {id(type(sub)): type(sub) for sub in module.modules()}
    modules = {}
    for t in classes.values():
        for base in t.__mro__:
            if base is object:
                continue
            modules.setdefault(base.__module__, sys.modules.get(base.__module__))
            for name, member in vars(base).items():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, types.FunctionType) and member.__closure__:
                    place = ("cell at", base.__module__, base.__qualname__, name)
                    _cells_of(member, place, (), cells, depth=3)
    for m in modules.values():
        for fn in list(vars(m).values()) if m is not None else ():
            if isinstance(fn, types.FunctionType) and fn.__closure__ and findable(fn):
                _cells_of(fn, ("cell at", fn.__module__, fn.__qualname__, None), (), cells,
                          depth=3)
    return cells


def _cells_of(fn, place: tuple, steps: tuple, cells: dict, depth: int) -> None:
    for i, cell in enumerate(fn.__closure__ or ()):
        cells.setdefault(id(cell), (*place, steps, i))
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if depth > 1 and isinstance(inner, types.FunctionType):
            _cells_of(inner, place, (*steps, i), cells, depth - 1)


def held_by_a_function(cell) -> bool:
    """Whether a live function's closure holds ``cell`` (asked only of the few cells no path
    names: ``gc.get_referrers`` walks every object)."""
    for closure in gc.get_referrers(cell):
        if isinstance(closure, types.FrameType):  # a running or suspended function's
            return True
        if type(closure) is tuple and any(
                isinstance(fn, types.FunctionType) and fn.__closure__ is closure
                for fn in gc.get_referrers(closure)):
            return True
    return False


def contents_of(cell) -> tuple:
    try:
        return (cell.cell_contents,)
    except ValueError:  # empty
        return ()


def cell_of(*contents):
    return types.CellType(*contents)


def _cell_at(module_name: str, qualname: str, member: str, steps: tuple, index: int):
    fn = lookup(module_name, qualname)
    fn = fn if member is None else vars(fn)[member]
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    for step in steps:
        fn = fn.__closure__[step].cell_contents
    return fn.__closure__[index]


def resolve(pid: tuple, root):
    """The object ``paths_of(root)`` named ``pid``, in the loading process's ``root``."""
    kind, name, *rest = pid
    if kind == "within":  # in a module tree a function's closure cell or global holds
        place, inner = name, rest[0]
        held = root.__closure__[place[1]].cell_contents if place[0] == "cell" \
            else root.__globals__[place[1]]
        if not isinstance(held, torch.nn.Module):
            raise LookupError(f"{place} no longer holds a module")
        return resolve(inner, held)
    if kind == "function":
        return root
    if kind == "function globals":
        return root.__globals__
    if kind == "closure":
        return root.__closure__
    if kind == "cell":
        return root.__closure__[name]
    if kind == "module":
        return root.get_submodule(name)
    if kind == "parameter":
        return root.get_parameter(name)
    if kind == "buffer":
        return root.get_buffer(name)
    if kind == "attribute":
        return vars(root.get_submodule(name))[rest[0]]
    if kind == "singleton":
        return getattr(importlib.import_module(name), rest[0])
    if kind == "import":
        return importlib.import_module(name)
    if kind == "globals":
        return vars(importlib.import_module(name))
    if kind == "cell at":  # a cell of a method of the tree or of its decorators' wrappers
        return _cell_at(name, *rest)
    if kind == "object at":  # what an identity check of a global expects (``guarded_objects``)
        steps, digest = rest
        obj = _follow(vars(importlib.import_module(name)), steps)
        if program_fingerprint.object_digest(obj) != digest:
            raise LookupError(f"{name}: the object at {steps} is not like the one kept")
        return obj
    if kind == "module object at":  # one the module tree holds (``guarded_objects``)
        steps, digest = name, rest[0]
        obj = _follow(root, steps)
        if program_fingerprint.object_digest(obj) != digest:
            raise LookupError(f"the module's object at {steps} is not like the one kept")
        return obj

    raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def guarded_objects(prologue, root, taken: dict) -> dict[int, tuple]:
    """The objects that the prologue's identity checks expect to find in a module's globals
    (``_active_collector is <the object compiled for>``; transformers' attention registries)
    or, for a jitted module ``root``, in its tree past the places ``paths_of`` names (``taken``),
    each named by that place and the digest of its contents. In another process "the same
    object" is the one at that place, if its contents (class, state, the code it holds) hash
    the same; a load finds it there (``_Unpickler``), and one whose contents differ is a miss.
    An identity check of any other object still makes the program not kept."""
    found = {}
    for b in prologue.bound_symbols:
        guard = getattr(getattr(b, "fields", None), "guard", None)
        if getattr(getattr(guard, "kind", None), "name", None) != "identity" or guard.path is None:
            continue
        steps, path = [], guard.path
        while not path.is_root:
            if not (path.is_item or path.is_attr or path.is_submodule):
                break
            steps.append(("item" if path.is_item else "sub" if path.is_submodule else "attr",
                          path.key))
            path = path.parent
        label = path.key if path.is_root else None
        steps = tuple(reversed(steps))
        if label == "module" and steps and isinstance(root, torch.nn.Module):
            # An object the module tree holds where no path of ``paths_of`` reaches (an entry
            # of a private attribute: the ``kernels`` package's per-layer function wrappers,
            # which transformers keeps in ``_kernel_funcs``): by its place in the tree.
            try:
                if _follow(root, steps) is guard.expected and id(guard.expected) not in taken:
                    found[id(guard.expected)] = (
                        "module object at", steps,
                        program_fingerprint.object_digest(guard.expected))
            except (Unstorable, LookupError, AttributeError, TypeError):
                pass
            continue
        if label == "globals" and steps:  # the jitted forward's module's: a module holding it
            module = next((m for m in list(sys.modules.values())
                           if isinstance(m, types.ModuleType)
                           and _follow_or_none(vars(m), steps) is guard.expected), None)
            name = getattr(module, "__name__", None)
        elif isinstance(label, GlobalsOf):
            name = label.module_name
            module = sys.modules.get(name)
            if module is not None and id(vars(module)) != label.address:
                module = None
        else:
            continue
        if module is None:
            continue
        try:
            if _follow(vars(module), steps) is not guard.expected:
                continue
            digest = program_fingerprint.object_digest(guard.expected)
        except (Unstorable, LookupError, AttributeError, TypeError):
            continue
        found[id(guard.expected)] = ("object at", name, steps, digest)
    return found


def _follow_or_none(obj, steps: tuple):
    try:
        return _follow(obj, steps)
    except (LookupError, AttributeError, TypeError):
        return None


def _follow(obj, steps: tuple):
    for kind, key in steps:
        obj = obj[key] if kind == "item" else obj._modules[key] if kind == "sub" else \
            getattr(obj, key)
    return obj


def module_globals() -> dict[int, tuple]:
    """Every imported module's globals dict (a prologue reads the forward's, ``fn_globals``)."""
    return {id(vars(m)): ("globals", name) for name, m in list(sys.modules.items())
            if isinstance(m, types.ModuleType)}


def findable(fn) -> bool:
    module = sys.modules.get(fn.__module__ or "")
    if module is None or "<locals>" in fn.__qualname__:
        return False
    target = module
    for part in fn.__qualname__.split("."):
        target = getattr(target, part, None)
    return target is fn


def lookup(module_name: str, qualname: str):
    target = sys.modules.get(module_name or "")
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target


def module_attribute(fn) -> str | None:
    """The name under which ``fn``'s module holds it, for a function a factory made there
    (``boolean_dispatch(...)`` in ``torch.nn.functional``: qualified name ``boolean_dispatch.
    <locals>.fn``); None if the module does not hold it."""
    module = sys.modules.get(fn.__module__ or "")
    if module is None:
        return None
    return next((name for name, value in vars(module).items() if value is fn), None)


def class_attribute(fn) -> tuple[type, str] | None:
    """The class of ``fn``'s module that holds it, and the name, for a function a wrapper made
    there under another function's name (``torch.Tensor.__pow__``, a wrapper of
    ``TensorBase.pow``); None if no class there holds it."""
    module = sys.modules.get(fn.__module__ or "")
    for owner in vars(module).values() if module is not None else ():
        if isinstance(owner, type):
            name = next((n for n, v in vars(owner).items() if v is fn), None)
            if name is not None:
                return owner, name
    return None


def decorated(fn, depth: int = 3) -> tuple | None:
    """How to reach ``fn`` from what its qualified name leads to, a wrapper a decorator made
    (transformers' ``forward`` under ``can_return_tuple``): the wrapper's ``__wrapped__`` or
    its closure cells, at most ``depth`` wrappers deep; ``None`` if it is not so reached."""
    if "<locals>" in fn.__qualname__:
        return None

    def search(obj, depth):
        if obj is fn:
            return ()
        if depth == 0 or not isinstance(obj, types.FunctionType):
            return None
        inner = getattr(obj, "__wrapped__", None)
        if inner is not None and (rest := search(inner, depth - 1)) is not None:
            return ("__wrapped__",) + rest
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if isinstance(contents, types.FunctionType) \
                    and (rest := search(contents, depth - 1)) is not None:
                return (i,) + rest
        return None
    return search(lookup(fn.__module__, fn.__qualname__), depth)


def undecorated(module_name: str, qualname: str, steps: tuple):
    target = lookup(module_name, qualname)
    for step in steps:
        target = target.__wrapped__ if step == "__wrapped__" else \
            target.__closure__[step].cell_contents
    if not isinstance(target, types.FunctionType) or target.__qualname__ != qualname:
        raise LookupError(f"{module_name}.{qualname} is no longer the decorated function kept")
    return target
