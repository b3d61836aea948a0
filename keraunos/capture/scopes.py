"""Scope guards: the globals and closure values the program reads, compiled in as constants.

It owns what capture knows of the program's Python scopes: the code of each Python function
the program called (each is guarded once), the globals and closure cells of those helpers
(where a real tensor met inside the program is read from on later calls), and the lists, dicts
and sets in those scopes, whose changes during capture are undone (``ScopeContainers``). Plain
values found there become value guards (``SCALE = 3.0`` after compiling must recompile).
"""
from __future__ import annotations

import collections
import dis
import functools
import gc
from typing import Any, Callable

import torch

from ..core.provenance import ATTR, ITEM, FoundByName, Path, root
from . import guards
from .guards import is_plain
from .scope_containers import ScopeContainers



class GlobalsOf(FoundByName):
    """The root a helper's globals are reached from, when they are not the jitted function's
    own: a name of the prologue's namespace (``<globals of NAME 0xADDR>``) that also says whose
    globals they are (``persist/places.py`` finds them again by it)."""

    def __new__(cls, module_name: str, address: int):
        self = str.__new__(cls, f"<globals of {module_name} {address:#x}>")
        self.module_name, self.address = module_name, address
        return self

    def __getnewargs__(self):
        return self.module_name, self.address


class ScopeGuards:
    """The scopes of one capture. ``fn`` is the Python function whose globals and closure the
    program reads; helpers' globals dicts and closure cells are put in ``root_objects`` (the
    capture's objects at the root of paths), and ``guard`` is the capture's ``guard``."""

    def __init__(self, fn, root_objects: dict[str, Any], guard: Callable,
                 watch_object: Callable[[Any, Path], None]):
        self.fn = fn
        self.root_objects = root_objects
        self.guard = guard
        self.watch_object = watch_object  # an object found by name: the reads' watch_scope_object
        self.helper_codes: set = set()  # code of the Python functions the program called
        # (globals path, globals dict, names loaded) and (path, cell) of those functions.
        self.helper_scopes: list[tuple[Path, dict, tuple]] = []
        self.helper_cells: list[tuple[Path, Any]] = []
        self.containers = ScopeContainers()  # lists, dicts, sets in globals and closures
        self.item_tensors: dict[int, Path] = {}  # tensors in those lists and dicts: their paths

    def path_of(self, t: torch.Tensor) -> Path | None:
        """Where ``t`` is read from in the function's globals or closure, or in those of a
        helper the program called; ``None`` when it is in none of them."""
        fn = self.fn
        code = getattr(fn, "__code__", None)
        if fn is not None and code is not None:
            for name in code.co_names:
                if fn.__globals__.get(name) is t:
                    return Path(root("globals"), ITEM, name)
            for i, cell in enumerate(fn.__closure__ or ()):
                try:
                    if cell.cell_contents is t:
                        return Path(Path(root("closure"), ITEM, i), ATTR, "cell_contents")
                except ValueError:
                    pass
        found = self.item_tensors.get(id(t))
        if found is not None:  # an item of a global list or dict (``W = [w0, w1]``)
            return found
        # A global or closure value of a helper the program called: read from there per call.
        for globals_path, helper_globals, names in self.helper_scopes:
            for name in names:
                if helper_globals.get(name) is t:
                    return Path(globals_path, ITEM, name)
        for path, cell in self.helper_cells:
            try:
                if cell.cell_contents is t:
                    return path
            except ValueError:
                pass
        return None

    def guard_function_scope(self) -> None:
        """Python values the function reads from its globals and closure are compiled in as
        constants: guard them (``SCALE = 3.0`` after compiling must recompile)."""
        fn = self.fn
        code = getattr(fn, "__code__", None)
        if code is None:
            return
        names: set[str] = set()
        stack = [code]
        while stack:
            c = stack.pop()
            names.update(c.co_names)
            stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
        for name in sorted(names):
            if name in fn.__globals__:
                self.containers.watch(f"the global `{name}`", fn.__globals__[name])
                self._guard_value(Path(root("globals"), ITEM, name), fn.__globals__[name])
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            self.containers.watch(f"`{code.co_freevars[i]}` of the closure", value)
            self._guard_value(Path(Path(root("closure"), ITEM, i), ATTR, "cell_contents"), value)

    def _guard_value(self, path: Path, value) -> None:
        """A value the program finds by name: a plain one is compiled in (guarded by value), an
        object is watched (its reads guarded)."""
        if is_plain(value) or _plain_collection(value):
            self.guard(guards.VALUE, path, value)
        elif type(value) in (list, tuple, dict):
            self._guard_items(path, value)
        elif not isinstance(value, torch.Tensor):
            self.watch_object(value, path)

    def _guard_items(self, path: Path, value, depth: int = 0) -> None:
        """A list, tuple or dict holding more than plain values (``ACTS = [torch.relu]``, a list
        of configs): its length or keys, and each item: a plain one by value, a function or
        object by identity (an object also watched), a nested container the same way. Past 3
        levels or 32 items, or in a dict keyed by anything but plain values (a table keyed by
        classes), only the in-place changes during capture are watched (not a check)."""
        if depth > 3 or len(value) > 32:
            return
        if type(value) is dict and not all(is_plain(k) for k in value):
            return
        if type(value) is dict:
            self.guard(guards.KEYS, path, (dict, tuple(value)))
            items = value.items()
        else:
            self.guard(guards.LENGTH, path, (type(value), len(value)))
            items = enumerate(value)
        for key, item in items:
            where = Path(path, ITEM, key)
            if is_plain(item):
                self.guard(guards.VALUE, where, item)
            elif type(item) in (list, tuple, dict):
                self._guard_items(where, item, depth + 1)
            elif isinstance(item, torch.Tensor):
                self.item_tensors[id(item)] = where  # read from there on every call (path_of)
            else:
                self.guard(guards.IDENTITY, where, item)
                self.watch_object(item, where)

    def guard_bound_self(self, method) -> None:
        """The object of a jitted bound method (``keraunos.jit(optimizer.step)``): the program
        reads it as ``self``, by name like a global."""
        obj = getattr(method, "__self__", None)
        if obj is None or isinstance(obj, (torch.nn.Module, type)) or not hasattr(method, "__func__"):
            return
        key = FoundByName(f"<self of {getattr(method, '__qualname__', 'the method')}>")
        self.root_objects[key] = obj
        self.watch_object(obj, root(key))

    def guard_helper_scope(self, frame) -> None:
        """A Python function the program called (a helper, a submodule's forward): the plain
        globals it loads and the plain values its closure holds are compiled in like the
        jitted function's own, so they are guarded the same way."""
        code = frame.f_code
        if code is getattr(self.fn, "__code__", None):
            return  # the jitted function itself: see guard_function_scope
        fn_globals = getattr(self.fn, "__globals__", None)
        globals_path = root("globals")
        if frame.f_globals is not fn_globals:
            key = GlobalsOf(frame.f_globals.get('__name__', '?'), id(frame.f_globals))
            self.root_objects[key] = frame.f_globals
            globals_path = root(key)
        names = _loaded_globals(code)
        self.helper_scopes.append((globals_path, frame.f_globals, names))
        for name in names:
            if name in frame.f_globals:
                self.containers.watch(f"the global `{name}` of {code.co_name}",
                                            frame.f_globals[name])
                self._guard_value(Path(globals_path, ITEM, name), frame.f_globals[name])
        # (A helper's closure may be the program's own: a function it defines, whose cells hold
        # what the program made. Only plain values are taken from closures of helpers.)
        if code.co_freevars and any(_plain_or_tensor(frame.f_locals.get(v))
                                    for v in code.co_freevars):
            for cell in _closure_cells(code, frame):
                key = FoundByName(f"<closure cell {id(cell):#x}>")
                self.root_objects[key] = cell
                path = Path(root(key), ATTR, "cell_contents")
                self.helper_cells.append((path, cell))
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                self.containers.watch(f"a closure variable of {code.co_name}", value)
                if is_plain(value):
                    self.guard(guards.VALUE, path, value)


@functools.lru_cache(maxsize=4096)
def _loaded_globals(code) -> tuple[str, ...]:
    return tuple(sorted({i.argval for i in dis.get_instructions(code)
                         if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}))


# Containers besides list, dict and tuple whose items the program reads in C, unseen: when they
# hold plain values they are compared by value (a copy) like a plain dict.
_COLLECTIONS = (collections.OrderedDict, collections.defaultdict, collections.deque, set,
                frozenset)


def _plain_collection(value) -> bool:
    if type(value) not in _COLLECTIONS:
        return False
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return all(is_plain(v) for v in value)


def _plain_or_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) or is_plain(value)


def _closure_cells(code, frame) -> list:
    """The closure cells of the function running in ``frame`` that hold plain values or tensors
    (frames do not name their function: it is found among the functions sharing ``code``)."""
    values = {v: frame.f_locals.get(v) for v in code.co_freevars}
    cells = []
    for fn in gc.get_referrers(code):
        if getattr(fn, "__code__", None) is not code or not fn.__closure__:
            continue
        pairs = list(zip(code.co_freevars, fn.__closure__))
        try:
            if all(cell.cell_contents is values[name] for name, cell in pairs):
                cells += [cell for _, cell in pairs if _plain_or_tensor(cell.cell_contents)]
        except ValueError:  # an empty cell
            continue
    return cells
