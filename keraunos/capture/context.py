"""The capture context: runs the user's program once on fake tensors and records what it does.

Three things are recorded at once:
- every torch call (through a ``TorchFunctionMode``), as a bound symbol on proxies;
- every value the program read from its inputs, module tree and globals, as a guard;
- every write the program made to a tensor input (in-place ops) or to a module attribute.

Fake tensors (``torch._subclasses.FakeTensorMode``) give every op with a meta kernel exact shape,
dtype, device and stride semantics without running it; one fake mode per capture, so inputs that
share storage become fakes that share storage.
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from ..core.aten import AtenRecorder, constant_line, is_lifted_constant
from ..core.effects import draws_random, is_inplace_by_name
from ..core.proxies import NameGenerator, TensorProxy
from ..core.symbols import BoundSymbol, Code, TorchSymbol
from ..core.tags import MUTATION, OPAQUE, RANDOM, STATIC_MEMORY_LOCATION
from ..errors import CaptureError, UnsupportedInputError, user_source
from . import guards
from .guards import DataRead, Guard, GuardKind, is_plain
from .leaks import is_tensor_subclass_with_dispatch
from .module_calls import ModuleCalls
from .scope_containers import ScopeContainers
from ..core.provenance import ATTR, BUFFER, ITEM, PARAMETER, SUBMODULE, Path, root

from .recording import (_recording_argument_class, _recording_module_class,
                        _recording_object_class, original_class)
from ..core.glue import SET_GLOBAL_STATE
from .state import global_state
from ..core.symbolic import SYMBOLIC_TYPES, SymbolicUnsupported, has_symbols, is_backed
from ..core.symbolic import hint as size_hint
from .symbolic import DynamicRequest, Symbols, data_read_description
from .symbolic import _from_call


@dataclass
class TensorInput:
    """A tensor the program reads that comes from outside it."""

    path: Path
    real: torch.Tensor
    fake: FakeTensor
    proxy: TensorProxy


@dataclass
class AttributeWrite:
    """``module.name = value`` done by the program; replayed by the epilogue."""

    module_path: Path
    name: str
    value: Any  # a fake tensor or a plain Python value


class CaptureContext:
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
        self.inputs: list[TensorInput] = []
        self._input_by_real: dict[int, TensorInput] = {}
        self.proxy_of: dict[int, TensorProxy] = {}   # id(fake) -> proxy
        self.storage_of: dict[str, int] = {}        # proxy name -> fake storage key
        self.fake_of: dict[str, FakeTensor] = {}     # proxy name -> fake
        self.bound_symbols: list[BoundSymbol] = []
        self.module_calls = ModuleCalls(module)  # the module calls running: each line's stack
        self.guards: list[Guard] = []
        self._guarded: set = set()
        self.mutated_storages: set[int] = set()
        self.mutated_with_grad: dict[int, bool] = {}
        self.attribute_writes: list[AttributeWrite] = []
        self.replayed_calls: list = []  # print, logging, warnings.warn: replayed.ReplayedCall
        self.metadata_changed_views: set[int] = set()  # storages of views changed by x.t_(), ...
        self.in_vmap = False
        self.specialize_data = False
        # specialize_data: the symbols of ints read from tensor data, by what computes them, and
        # the user's line of each (a read's place among the reads of its line names it).
        self._data_reads: dict[tuple, Any] = {}
        self._data_places: list = []
        self.helper_codes: set = set()  # code of the Python functions the program called
        # (globals path, globals dict, names loaded) and (path, cell) of those functions.
        self.helper_scopes: list[tuple[Path, dict, tuple]] = []
        self.helper_cells: list[tuple[Path, Any]] = []
        self.scope_containers = ScopeContainers()  # lists, dicts, sets in globals and closures
        # (path, stand-in, contents at the start): list and dict arguments the program may change.
        self.containers: list[tuple[Path, Any, Any]] = []
        self._overlay: dict[int, dict[str, Any]] = {}
        self.argument_objects: set[int] = set()  # ids of plain objects passed in (writable)
        self.state = self.initial_state = global_state()
        # Where each module, parameter and buffer of the tree lives, for values that reach the
        # program without an attribute read we saw (ModuleList iteration, self.parameters()).
        self.module_paths: dict[int, Path] = {}
        self.tensor_paths: dict[int, Path] = {}
        self._swapped: list[tuple[Any, type]] = []
        self._object_paths: dict[int, Path] = {}
        # The Python function whose globals and closure the program reads.
        self.fn = _python_function(type(module).forward if module is not None else fn)
        self.root_module = module
        self.arg_names = _positional_names(module.forward if module is not None else fn)
        # Objects at the root of paths that start neither at the call nor at the module.
        self.root_objects: dict[str, Any] = {}
        if module is not None:
            self._index_module_tree(module)
        self.tree_modules = set(self.module_paths)

    # ----------------------------------------------------------------------------- inputs
    def _index_module_tree(self, module: torch.nn.Module) -> None:
        for name, sub in module.named_modules(remove_duplicate=False):
            path = root("module")
            for part in name.split(".") if name else []:
                path = Path(path, SUBMODULE, part)
            self.module_paths.setdefault(id(sub), path)
            for kind, table in ((PARAMETER, sub._parameters), (BUFFER, sub._buffers)):
                for key, t in table.items():
                    if t is not None:
                        self.tensor_paths.setdefault(id(t), Path(path, kind, key))

    def guard(self, kind: GuardKind, path: Path | None, expected: Any,
              expression: str | None = None):
        key = (kind, path, expression)
        if key in self._guarded:
            return
        self._guarded.add(key)
        from_module = path is not None and path.is_module_derived()
        self.guards.append(Guard(kind, path, expected, expression, from_module))

    def tensor_input(self, real: torch.Tensor, path: Path, tags=()) -> FakeTensor:
        if is_tensor_subclass_with_dispatch(real):
            raise UnsupportedInputError(
                f"keraunos.jit: {path} is a {type(real).__qualname__}, a tensor subclass that "
                f"runs its own __torch_dispatch__ (DTensor, a quantized or nested tensor, ...); "
                f"keraunos does not capture through such subclasses yet, and taking it for a "
                f"plain tensor would compute something else.\n  What to do: pass its local or "
                f"plain tensor (DTensor.to_local(), .to_dense(), .dequantize()), or call this "
                f"part outside the jitted function (torch.compile(..., backend=\"keraunos\") "
                f"does not take them either yet).")
        if real.layout != torch.strided:
            raise UnsupportedInputError(
                f"keraunos.jit: {path} is a {real.layout} tensor; keraunos captures strided "
                f"(dense) tensors only. Convert it with .to_dense(), or call this op outside the "
                f"jitted function.")
        known = self._input_by_real.get(id(real))
        if known is not None:
            if known.path != path:
                self.guard(guards.IDENTITY, path, known)  # the same tensor reached two ways
            return known.fake
        dynamic = self.dynamic.tensor_dims(real, path) if self.dynamic is not None else None
        with self.fake_mode, torch._C.DisableTorchFunction():  # conversion is not the program
            fake = None
            if dynamic is not None and any(d and n > 1 for d, n in zip(dynamic, real.shape)):
                try:
                    fake = self.symbols.tensor_fake(real, path, dynamic)
                except SymbolicUnsupported:
                    fake = None  # this input keeps its exact sizes
            if fake is None:
                fake = self.fake_mode.from_tensor(real)
        hint = path.name_hint()
        if path.parent is not None and path.parent.is_root and path.parent.key == "args":
            hint = self.arg_names.get(path.key, hint)
        elif path.parent is not None and path.parent.is_root and path.parent.key == "kwargs":
            hint = str(path.key)
        proxy = TensorProxy(self.names.fresh(hint), fake, set(tags), str(path))
        if self.symbols is not None:
            self.symbols.bind_tensor(fake, proxy, path)
        entry = TensorInput(path, real, fake, proxy)
        self.inputs.append(entry)
        self._input_by_real[id(real)] = entry
        self._register(fake, proxy)
        return fake

    def _register(self, fake: FakeTensor, proxy: TensorProxy) -> None:
        self.proxy_of[id(fake)] = proxy
        self.fake_of[proxy.name] = fake  # also keeps the fake alive, so ids stay unique
        self.storage_of[proxy.name] = fake.untyped_storage()._cdata

    def value_input(self, value: Any, path: Path, tags=()) -> Any:
        """The stand-in the program sees for ``value`` found at ``path``; records its guards."""
        if isinstance(value, torch.Tensor):
            return self.tensor_input(value, path, tags)
        if type(value) is int and self.dynamic is not None and \
                self.dynamic.int_is_dynamic(value, path):
            symint, proxy = self.symbols.int_input(value, path)
            if proxy is not None:
                self.guard(guards.SYMBOLIC_INT, path, proxy)
                return symint
        # A list or dict that came with the call (an argument, or held by an object passed in: a
        # cache's list of layers) is a container the program may change, even while it holds only
        # plain values: the program gets a stand-in, and the epilogue replays its changes.
        held = type(value) in (list, dict) and _from_call(path)
        if is_plain(value) and not path.is_root and not held:
            self.guard(guards.VALUE, path, value)
            return value
        if type(value) in (tuple, list) or _is_namedtuple(value):
            self.guard(guards.LENGTH, path, (type(value), len(value)))
            items = [self.value_input(v, Path(path, ITEM, i), tags) for i, v in enumerate(value)]
            stand_in = type(value)(*items) if _is_namedtuple(value) else type(value)(items)
            if type(value) is list:
                self.containers.append((path, stand_in, list(stand_in)))
            return stand_in
        if type(value) is dict:
            self.guard(guards.KEYS, path, (dict, tuple(value)))
            stand_in = {k: self.value_input(v, Path(path, ITEM, k), tags)
                        for k, v in value.items()}
            self.containers.append((path, stand_in, dict(stand_in)))
            return stand_in
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and not path.is_attr:
            self.guard(guards.TYPE, path, type(value))
            copy = object.__new__(type(value))
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                object.__setattr__(copy, f.name, self.value_input(v, Path(path, ATTR, f.name), tags))
            return copy
        if path.is_module_derived() or path.key in ("globals", "closure"):
            # Anything else the module or function holds (a config object, a function) must be the
            # very same object; plain objects are also watched field by field as they are read.
            self.guard(guards.IDENTITY, path, value)
            self._watch_object(value, path)
            return value
        if not path.is_root and _from_call(path) and self._watch_object(value, path,
                                                                         writable=True):
            # A plain object passed in (a KV cache): its class is checked, each attribute the
            # program reads is an input with its own checks, and its writes are replayed.
            self.guard(guards.TYPE, path, original_class(value))
            return value
        raise UnsupportedInputError(_unsupported_input_message(path, value))

    def real_tensor_reached_program(self, t: torch.Tensor) -> FakeTensor:
        """A real tensor met inside the program: a parameter read without our seeing the read
        (``self.parameters()``), a global, a closure variable, or an object attribute."""
        path = self.tensor_paths.get(id(t))
        tags = (STATIC_MEMORY_LOCATION,)
        if path is None:
            path, tags = self._find_in_function_scope(t), ()
        return self.tensor_input(t, path, tags)

    def _find_in_function_scope(self, t: torch.Tensor) -> Path:
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
        # Held by some other object: the program keeps reading this very tensor.
        key = f"<captured tensor {id(t):#x}>"
        self.root_objects[key] = t
        return root(key)

    def saw_before_the_call(self, obj) -> bool:
        """Whether ``obj`` existed before the program ran, as far as capture can tell."""
        return (id(obj) in self._object_paths or id(obj) in self.module_paths
                or any(v is obj for v in self.root_objects.values())
                or any(g.kind is guards.IDENTITY and g.expected is obj for g in self.guards))

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
                self.scope_containers.watch(f"the global `{name}`", fn.__globals__[name])
            if name in fn.__globals__ and is_plain(fn.__globals__[name]):
                self.guard(guards.VALUE, Path(root("globals"), ITEM, name), fn.__globals__[name])
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            self.scope_containers.watch(f"`{code.co_freevars[i]}` of the closure", value)
            if is_plain(value):
                self.guard(guards.VALUE,
                           Path(Path(root("closure"), ITEM, i), ATTR, "cell_contents"), value)

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
            key = f"<globals of {frame.f_globals.get('__name__', '?')} {id(frame.f_globals):#x}>"
            self.root_objects[key] = frame.f_globals
            globals_path = root(key)
        names = _loaded_globals(code)
        self.helper_scopes.append((globals_path, frame.f_globals, names))
        for name in names:
            if name in frame.f_globals:
                self.scope_containers.watch(f"the global `{name}` of {code.co_name}",
                                            frame.f_globals[name])
            if name in frame.f_globals and is_plain(frame.f_globals[name]):
                self.guard(guards.VALUE, Path(globals_path, ITEM, name), frame.f_globals[name])
        if code.co_freevars and any(_plain_or_tensor(frame.f_locals.get(v))
                                    for v in code.co_freevars):
            for cell in _closure_cells(code, frame):
                key = f"<closure cell {id(cell):#x}>"
                self.root_objects[key] = cell
                path = Path(root(key), ATTR, "cell_contents")
                self.helper_cells.append((path, cell))
                try:
                    self.scope_containers.watch(f"a closure variable of {code.co_name}",
                                                cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
                if is_plain(cell.cell_contents):
                    self.guard(guards.VALUE, path, cell.cell_contents)

    # ----------------------------------------------------------------------- module reads
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
            return self.value_input(d[name], Path(mpath, ATTR, name))
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
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self.real_tensor_reached_program(value)
        if not (isinstance(value, FakeTensor) or is_plain(value)):
            raise CaptureError(
                f"keraunos: the program sets {self.module_path(module)}.{name} to a "
                f"{type(value).__qualname__} at {user_source()}; only tensors and plain Python "
                f"values can be written to modules inside a jitted forward. Move the assignment "
                f"out of forward.")
        self._overlay.setdefault(id(module), {})[name] = value
        self.attribute_writes.append(AttributeWrite(self.module_path(module), name, value))

    def _watch_object(self, obj: Any, path: Path, writable: bool = False) -> bool:
        """Swap in a recording class; whether ``obj`` is watched (at ``path``) afterwards.
        ``writable``: the object came with the call, so the program's writes to it are recorded
        and replayed by the epilogue rather than made to the object during capture."""
        if id(obj) in self._object_paths or isinstance(obj, torch.nn.Module):
            return self._object_paths.get(id(obj)) == path
        cls = original_class(obj)
        if not hasattr(obj, "__dict__") or cls.__module__ == "builtins" or isinstance(obj, type) \
                or callable(obj):
            return False
        try:
            obj.__class__ = (_recording_argument_class if writable else _recording_object_class)(cls)
        except TypeError:
            return False
        self._object_paths[id(obj)] = path
        self._swapped.append((obj, cls))
        if writable:
            self.argument_objects.add(id(obj))
        return True

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
        if id(obj) in self.argument_objects:
            return self._argument_getattr(obj, d, cls, name)
        if cls.__getattribute__ is not object.__getattribute__:
            # The object resolves names itself (a config's attribute_map, say): read through it.
            value = cls.__getattribute__(obj, name)
            if name in d or is_plain(value):
                return self.value_input(value, Path(self._object_paths[id(obj)], ATTR, name))
            return value
        if name in d:
            return self.value_input(d[name], Path(self._object_paths[id(obj)], ATTR, name))
        return object.__getattribute__(obj, name)

    def object_state_read(self, obj) -> None:
        """The program reads the whole state of a watched object at once: it copies or pickles
        it, or reads its ``__dict__`` (a config's ``to_dict()``). Every attribute counts as read,
        so the copy's values are guarded like the original's; nested objects become watched
        here, and a deep copy reads their state in turn."""
        path = self._object_paths.get(id(obj))
        if path is None:
            return  # made by the program: its state came from reads already recorded
        d = object.__getattribute__(obj, "__dict__")
        if id(obj) not in self.argument_objects:
            for name in list(d):
                self.value_input(d[name], Path(path, ATTR, name))
            return
        cls = original_class(obj)
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
            with torch._C.DisableTorchFunction():
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

    # ------------------------------------------------------------------------- torch calls
    def proxy(self, fake: torch.Tensor) -> TensorProxy:
        proxy = self.proxy_of.get(id(fake))
        if proxy is None:
            raise CaptureError(f"keraunos: internal error: a tensor of unknown origin reached "
                               f"{user_source()}. Please report this with the program.")
        return proxy

    def output_proxy(self, fake: torch.Tensor) -> TensorProxy:
        proxy = self.proxy_of.get(id(fake))
        if proxy is None:
            proxy = TensorProxy(self.names.fresh(), fake)
            self._register(fake, proxy)
        return proxy

    def emit(self, bsym: BoundSymbol) -> None:
        """Record a line of the computation, with the module calls it was made in."""
        bsym.module_stack = self.module_calls.current
        self.bound_symbols.append(bsym)

    def record_global_state(self, final: bool = False) -> None:
        """Record switches of grad mode and autocast the program makes (``with torch.no_grad()``,
        ``with torch.autocast(...)`` inside it), so the computation switches at the same points."""
        state = global_state() if not final else self.initial_state
        if state != self.state:
            changes = tuple((i, v) for i, (v, old) in enumerate(zip(state, self.state)) if v != old)
            self.emit(BoundSymbol(SET_GLOBAL_STATE, (changes,), tags={MUTATION},
                                  source=None if final else user_source()))
            self.state = state

    def specialize_on_data(self, symbol, func, args, kwargs):
        """``jit(..., specialize_data=True)``: a Python value read from tensor data (``.item()``,
        ``bool(t)``) is computed now from the real inputs; the prologue recomputes it on every
        call. An int whose value changes between compilations (a position in a KV cache) becomes
        a size symbol (``Symbols.data_input``): the program's decisions on it are guards, checked
        like those on sizes, and its slices are symbolic; any other value is compiled in as a
        constant and checked to be the same (else: recompile)."""
        tensor = args[0]
        target = self.proxy(tensor)
        lines = self._slice(target.name)
        if any(b.tags & {MUTATION, RANDOM, OPAQUE} for b in lines) or self._written_before(
                target, lines):
            raise CaptureError(
                f"keraunos cannot specialize on `{symbol.name}` at {user_source()}: the value "
                f"depends on random or in-place ops, which the prologue cannot rerun.")
        source = user_source()
        reuse = self._data_reads.get(_read_key(lines, target, symbol.name))
        if reuse is not None:  # the same value read again (each layer reads the position)
            return reuse
        value = self._data_value(target, lines, func, args, kwargs)
        symbolic = self._data_symbol(value, target, symbol.name, lines, source)
        if symbolic is not None:
            self._data_reads[_read_key(lines, target, symbol.name)] = symbolic
            return symbolic
        self.guards.append(Guard(guards.DATA, None, value,
                                 expression=f"{target.name}.{symbol.name}()",
                                 read=DataRead(lines, target, symbol.name, source)))
        return value

    def _data_value(self, target, lines, func, args, kwargs):
        """The value the real inputs give, computed with the recorded ``lines`` (sizes at their
        values in this call: the prologue reads the same symbols before it computes them)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        def real(x):
            if isinstance(x, TensorProxy):
                return env[x.name]
            if type(x) is slice:  # pytree keeps slices whole: x[:n] with n a size symbol
                return slice(real(x.start), real(x.stop), real(x.step))
            if isinstance(x, Code):
                if not isinstance(getattr(x, "value", None), SYMBOLIC_TYPES):
                    raise SymbolicUnsupported("a value read from tensor data depends on a "
                                              "value the prologue cannot compute")
                return size_hint(x.value)
            return x
        env = {e.proxy.name: e.real for e in self.inputs}
        with unset_fake_temporarily(), torch._C.DisableTorchFunction():
            for b in lines:
                fn_args, fn_kwargs = pytree.tree_map(real, (b.args, b.kwargs))
                out = b.symbol.fn(*fn_args, **fn_kwargs)
                for p, v in zip(pytree.tree_leaves(b.outputs), pytree.tree_leaves(out)):
                    if isinstance(p, TensorProxy):
                        env[p.name] = v
            return func(env[target.name], *args[1:], **kwargs)

    def _data_symbol(self, value, target, method: str, lines, source):
        """The ``SymInt`` the program gets for an int read from tensor data, or ``None`` when the
        value stays a constant (not an int, not asked to vary, or 0 or 1)."""
        if self.dynamic is None or type(value) is not int:
            return None
        place = (source.filename, source.lineno) if source is not None else None
        key = ("data read", place, method, self._data_places.count(place))
        where = data_read_description(method, source)
        if not self.dynamic.data_is_dynamic(value, key, where):
            return None
        symint, proxy = self.symbols.data_input(value, target, method, lines, source)
        if proxy is None:
            return None
        self._data_places.append(place)
        return symint

    def _written_before(self, target, lines) -> bool:
        """Whether the program wrote, before this read, to memory the value is computed from:
        the prologue computes it from the inputs as they were passed (a write through another
        view of the same memory is not among ``lines``)."""
        read = {p.name for b in lines for p in b.input_proxies()} | {target.name}
        return any(self.storage_of.get(name) in self.mutated_storages for name in read)

    def _slice(self, name: str) -> list[BoundSymbol]:
        """The recorded lines that compute ``name`` from the inputs, in order."""
        needed, lines = {name}, []
        for b in reversed(self.bound_symbols):
            if any(p.name in needed for p in b.output_proxies()):
                lines.append(b)
                needed.update(p.name for p in b.input_proxies())
        return list(reversed(lines))

    def record_vmap(self, batched, args, kwargs):
        """Run a ``torch.vmap``-ed function on the fakes, recording the ATen ops its batching
        rules run (functorch's batched tensors never reach the torch function level we record)."""
        self.record_global_state()
        recorder = AtenRecorder()
        self.in_vmap = True
        try:
            with recorder:
                out = batched(*args, **kwargs)
        finally:
            self.in_vmap = False
        source = user_source()

        def arg(x):
            if isinstance(x, torch.Tensor):
                proxy = self.proxy_of.get(id(x))
                if proxy is None:
                    raise CaptureError(f"keraunos: a tensor of unknown origin inside torch.vmap "
                                       f"at {source}; pass it to the vmapped function instead.")
                return proxy
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                if self.backed(x):
                    return self.symbols.code(x)
                raise CaptureError(f"keraunos: a size that depends on data inside torch.vmap at "
                                   f"{source}")
            return x
        for call in recorder.calls:
            outputs = pytree.tree_map(
                lambda t: self.output_proxy(t) if isinstance(t, torch.Tensor) else t, call.out)
            if is_lifted_constant(call):
                self.emit(constant_line(call.args[0], outputs, source))
                continue
            call_args, call_kwargs = pytree.tree_map(arg, (call.args, call.kwargs))
            tags = set()
            if call.func._schema.is_mutable:
                tags.add(MUTATION)
                for t in pytree.tree_leaves((call.args, call.kwargs)):
                    if isinstance(t, torch.Tensor):
                        self.mutated_storages.add(t.untyped_storage()._cdata)
                        self.mutated_with_grad.setdefault(t.untyped_storage()._cdata,
                                                          torch.is_grad_enabled())
            self.emit(BoundSymbol(
                TorchSymbol(call.func, f"torch.ops.{call.func}", "function"), tuple(call_args),
                dict(call_kwargs), outputs, source, tags))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                arg(t)  # every result must be a value the trace defines
        return out

    def record_rng(self, name: str, original, args, kwargs):
        symbol = TorchSymbol(original, f"torch.{name}", "function")
        args, kwargs = pytree.tree_map(
            lambda x: self.proxy(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        outputs, result = None, None
        if name == "get_rng_state":
            real = original()
            with torch._C.DisableTorchFunction():  # a stand-in; callers may have no_dispatch() on
                result = torch.empty(real.shape, dtype=real.dtype, device="meta")
                outputs = self.output_proxy(result)
        self.emit(BoundSymbol(symbol, tuple(args), dict(kwargs), outputs,
                              user_source(), {MUTATION, RANDOM}))
        return result

    def backed(self, value) -> bool:
        """Whether a symbolic value is an expression of the input symbols (not of tensor data)."""
        return self.symbols is not None and is_backed(value, self.symbols.bindings)

    def run_opaque(self, func, args, kwargs, for_output: bool = True):
        """Run ``func`` on real zero tensors shaped like the fakes; return fakes of its outputs."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        def real(x):
            if isinstance(x, torch.Tensor):
                t = torch.empty_strided([size_hint(n) for n in x.shape],
                                        [size_hint(n) for n in x.stride()],
                                        dtype=x.dtype, device=x.device)
                return t.zero_().requires_grad_(x.requires_grad) if x.dtype.is_floating_point \
                    else t.zero_()
            return x
        with unset_fake_temporarily(), torch._C.DisableTorchFunction():
            real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
            out = func(*real_args, **real_kwargs)
            if for_output and self.symbols is not None and any(
                    isinstance(x, SYMBOLIC_TYPES) or isinstance(x, torch.Tensor) and
                    has_symbols(x) for x in pytree.tree_leaves((args, kwargs))):
                # Its output's sizes would be those of this call, not symbols.
                raise SymbolicUnsupported(f"{func} has no fake kernel")
            return pytree.tree_map(
                lambda t: self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                out)

    def record(self, symbol: TorchSymbol, args, kwargs, out, mutated: list[torch.Tensor],
               opaque: bool = False):
        def to_proxy(x):
            if isinstance(x, SYMBOLIC_TYPES):
                return self.symbols.code(x)
            if type(x) is slice and self.symbols is not None:  # x[:, :n]: pytree keeps slices
                return slice(to_proxy(x.start), to_proxy(x.stop), to_proxy(x.step))
            return self.proxy(x) if isinstance(x, torch.Tensor) else x
        p_args, p_kwargs = pytree.tree_map(to_proxy, (args, kwargs))
        outputs = pytree.tree_map(
            lambda x: self.output_proxy(x) if isinstance(x, torch.Tensor) else x, out)
        tags = set()
        if mutated or is_inplace_by_name(symbol):
            tags.add(MUTATION)
            for t in mutated:
                key = t.untyped_storage()._cdata
                self.mutated_storages.add(key)
                # Whether any write happened with grad mode on: the epilogue's copy-back follows.
                self.mutated_with_grad[key] = self.mutated_with_grad.get(key, False) or \
                    torch.is_grad_enabled()
        if draws_random(symbol, args, kwargs):
            tags.add(RANDOM)
        comment = None
        if opaque:
            tags |= {OPAQUE, MUTATION}  # unknown effects: never removed or merged
            comment = "opaque: no fake kernel; output metadata from a run on zeros"
        self.emit(BoundSymbol(symbol, tuple(p_args), dict(p_kwargs), outputs,
                              user_source(), tags, comment=comment))


def _read_key(lines, target, method: str) -> tuple:
    """What a read from tensor data computes, without the names of this capture: two reads
    with one key compute the same value from the same inputs (each layer of a model reading
    ``input_pos.max().item()``)."""
    made: dict[str, int] = {}

    def canonical(x):
        if isinstance(x, TensorProxy):
            return ("line", made[x.name]) if x.name in made else ("input", x.name)
        return repr(x)
    key = []
    for i, b in enumerate(lines):
        function = getattr(b.symbol, "fn", b.symbol)  # symbols are made per call site
        key.append((id(function), repr(pytree.tree_map(canonical, (b.args, b.kwargs)))))
        for p in b.output_proxies():
            made[p.name] = i
    return tuple(key), canonical(target), method


def _rnn_flat_weights(ctx: CaptureContext, module: torch.nn.RNNBase) -> list:
    """``_flat_weights`` as ``RNNBase.forward`` leaves it once ``_update_flat_weights`` ran: the
    parameters named in ``_flat_weights_names`` (``None`` for one the module lacks)."""
    weights = []
    for name in ctx.module_getattr(module, "_flat_weights_names"):
        try:
            weights.append(ctx.module_getattr(module, name))
        except AttributeError:
            weights.append(None)
    return weights


def _rnn_flat_weight_refs(ctx: CaptureContext, module: torch.nn.RNNBase) -> list:
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


@functools.lru_cache(maxsize=4096)
def _loaded_globals(code) -> tuple[str, ...]:
    return tuple(sorted({i.argval for i in dis.get_instructions(code)
                         if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}))


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


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _unsupported_input_message(path, value) -> str:
    """Why ``value`` (passed at ``path``) cannot be an input, where the call was, and what to
    pass instead: NumPy values have an exact tensor or number equivalent."""
    kind = type(value)
    where = user_source()
    at = (f" (the call at {where.filename}:{where.lineno}{': ' + where.code if where.code else ''})"
          if where else "")
    message = (f"keraunos.jit: {path} is a {kind.__module__}.{kind.__qualname__}{at}, which "
               f"keraunos cannot check on later calls.")
    if kind.__module__ == "numpy" and kind.__name__ == "ndarray":
        return (f"{message} Pass a tensor instead: torch.from_numpy(array) shares the array's "
                f"memory; torch.as_tensor(array, dtype=..., device=...) converts it.")
    if kind.__module__ == "numpy" and hasattr(value, "item"):  # a NumPy scalar: np.float32(1.0)
        return f"{message} Pass a Python number instead: value.item(), or float(value)."
    return (f"{message} Pass tensors, numbers, strings, None, dtypes, devices, or "
            f"tuples/lists/dicts/dataclasses of those.")
