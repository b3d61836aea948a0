"""Captured programs kept between processes, so that a restart skips capture and the passes
before the executors' claims.

What is kept, per cache entry of a jitted module: the traces as the passes left them just before
the fast prologue (the readable prologue, the computation, the epilogue, the backward and what the
autograd split knows of it), pickled. What a trace refers to in the live program (the module, its
submodules, parameters and buffers, and the objects held in submodules' attributes) is kept as its
path from the root module and found again in the loading process's module; functions and classes
are kept by their qualified names (pickle checks that the name leads back to the same object),
keraunos's own closures by their code; any other object makes the entry not kept
(``compile_stats(jitted).program_store`` says why). The claims, the fusion regions (each region's compiled
module comes from the kernel store, ``executors/fusion/kernel_store.py``), the fast prologue and
code generation run again on a load: they are cheap, and they depend on what this process has.

A load is used like a capture: its readable prologue runs on the call first, and only if it
accepts the call (every check that capture would have written: tensor metadata, module
structure, module attributes, Python values, global state) and the call's inputs share memory
as the capturing call's did (the row holds that: ``cache.sharing_of``, checked in
``pipeline.compile_entry``) does the entry go into the cache; anything else captures as usual. The
key (``key_of``) covers what the prologue cannot check, chiefly the Python code that ran;
docs/limitations.md says exactly what it covers and what it cannot see.
``KERAUNOS_PROGRAM_STORE=0`` turns it off; ``keraunos cache clear`` empties it.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import io
import logging
import marshal
import os
import pathlib
import pickle
import platform
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import sympy
import torch
from torch.utils import _pytree as pytree

from .. import background
from . import places, store
from ..torch_internals.dispatch import OpOverload, OpOverloadPacket, dispatch_keys
from ..torch_internals.dynamo import GlobalStateGuard
from ..torch_internals.fake import ShapeEnv, ShapeGuard, SLoc, ValueRanges
from .fingerprint import _SIMPLE, Unstorable, _tensor, code_fingerprint, function_fingerprint
from ..capture.symbolic import Symbols
from ..core import glue
from ..core.provenance import ITEM, Path, root as path_root
from ..core.proxies import Proxy, TensorProxy
from ..core.symbolic import SizePrinter, SymbolicValue
from ..core.trace import Trace
from ..capture.retarget import expecting_values_of, with_example
from ..version import __version__

NAMESPACE = "program"  # the store's namespace for these rows
FORMAT = 4             # bump when what a row holds, or how it is loaded, changes


@dataclass
class StoredProgram:
    """What the store keeps of one compilation: the traces as the stages before the fast
    prologue left them, and the facts of its capture that a load needs."""

    prologue: Trace                  # the readable prologue (on a load: made from this call)
    computation: Trace
    epilogue: Trace
    backward: Trace | None
    split: Any                       # the autograd split (``autograd/split.py``), or None
    check_descriptions: list         # what each of the prologue's checks is (miss reasons)
    facts: tuple                     # (inputs, written, not handed on): ``codegen``
    seen_sizes: dict                 # what capture told automatic dynamic of each input's sizes
    # How the inputs of the call that captured it shared memory (``cache.sharing_of``): a call
    # it serves must repeat it.
    sharing: tuple | None = None
    format: int = FORMAT


def enabled() -> bool:
    return os.environ.get("KERAUNOS_PROGRAM_STORE", "1") not in ("0", "")


# ------------------------------------------------------------------------------------ the key
def key_of(root, forward, options_text: str, args: tuple, kwargs: dict,
           sizes=None, sharing=None) -> str:
    """The store's key for a capture of ``root`` on this call: a module (called through
    ``forward``) or a jitted Python function. It covers keraunos's own source, torch's and
    Python's versions, the options, the code the program may run (``code_fingerprint``), the
    module tree (paths, classes, parameters' and buffers' metadata) or the function's name, the
    call's input metadata and the global state. ``sizes``: the ``DynamicRequest`` that decides
    which sizes and ints of the call are symbols (a scratch copy, asked here as capture will ask
    it), whose symbolic sizes are keyed as symbols, not by value. ``sharing``: how the call's
    tensors, parameters and buffers share memory (``keeping.call_sharing``), so that programs
    of calls that share it otherwise are rows of their own. Raises ``Unstorable``."""
    if isinstance(root, torch.nn.Module):
        tree, code = _module_tree(root), code_fingerprint(root, forward)
    else:
        tree, code = _function_name(root), function_fingerprint(root)
    parts = [FORMAT, _keraunos_source_hash(), __version__, torch.__version__,
             torch.version.git_version, sys.version, platform.machine(), options_text,
             _global_state(), tree, code, _inputs(args, kwargs, sizes), sharing]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _function_name(fn) -> tuple:
    """A jitted function is found again as the function the loading process jits: the key holds
    its module and qualified name, and ``function_fingerprint`` its code and what it reads."""
    if type(fn) is not types.FunctionType:
        raise Unstorable(f"a jitted {type(fn).__qualname__} (only Python functions and modules "
                         f"are kept)")
    return ("function", fn.__module__, fn.__qualname__)


@functools.lru_cache(maxsize=None)
def _keraunos_source_hash() -> str:
    """Every source file of the keraunos package: a program kept by one checkout is not loaded
    by another, whatever the version string says."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_PACKAGE = pathlib.Path(__file__).parent.parent  # keraunos/: capture, passes, executors, ...


def source_files() -> list[pathlib.Path]:
    """The package's Python files, which a stored program's key covers."""
    return sorted(_PACKAGE.rglob("*.py"))


def _global_state() -> tuple:
    guard = GlobalStateGuard()
    return (guard.__getstate__(), torch.is_inference_mode_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype())


def _module_tree(module: torch.nn.Module) -> tuple:
    described = []
    for name, sub in module.named_modules(remove_duplicate=False):
        t = type(sub)
        described.append((name, t.__module__, t.__qualname__, sub.training))
    for name, p in module.named_parameters(remove_duplicate=False):
        described.append((name, _tensor(p)))
    for name, b in module.named_buffers(remove_duplicate=False):
        described.append((name, _tensor(b)))
    return tuple(described)


def _inputs(args: tuple, kwargs: dict, sizes=None) -> tuple:
    """The call's inputs as the key holds them: their metadata, plain values by value; with
    ``sizes`` (a ``DynamicRequest``), a size or int it makes a symbol as ``"*"`` (the readable
    prologue checks the symbols' guards on a load) and the strides of such a tensor left out."""
    seen: dict[int, str] = {}

    def describe(v, path, depth=0):
        if depth > 8:
            raise Unstorable("inputs nested too deeply")
        t = type(v)
        if t is int and sizes is not None and not path.is_root \
                and sizes.int_is_dynamic(v, path) and v not in (0, 1):
            return ("int", "*")  # (0 and 1 are never symbols: capture specializes them)
        if t is float and sizes is not None and sizes.float_is_dynamic(v, path):
            return ("float", "*")  # an optimizer's learning rate that changed
        if t in _SIMPLE:
            return (t.__name__, repr(v))
        if isinstance(v, torch.Tensor):
            if id(v) in seen:  # capture takes it once, and checks the second path's identity
                return ("the tensor at", seen[id(v)])
            seen[id(v)] = str(path)
            described = _tensor(v)
            if sizes is None:
                return described
            dynamic = [d and n > 1 for d, n in zip(sizes.tensor_dims(v, path), v.shape)]
            if not any(dynamic):
                return described
            shape = tuple("*" if d else n for d, n in zip(dynamic, v.shape))
            return (*described[:2], shape, *described[5:])
        if t in (tuple, list):
            return (t.__name__, tuple(describe(x, Path(path, ITEM, i), depth + 1)
                                      for i, x in enumerate(v)))
        if t is dict and all(type(k) is str for k in v):
            return ("dict", tuple((k, describe(x, Path(path, ITEM, k), depth + 1))
                                  for k, x in v.items()))
        if isinstance(v, (torch.dtype, torch.device)):
            return (t.__name__, str(v))
        raise Unstorable(f"an argument of type {t.__qualname__}")
    return describe(args, path_root("args")), describe(kwargs, path_root("kwargs"))


# ------------------------------------------------------------------------- pickling the traces
class _Pickler(pickle.Pickler):
    """Pickles traces: objects of the live program by their path from the root module;
    functions and classes by name, keraunos's own closures by their code; plain values and
    keraunos's own records by value. Anything else raises ``Unstorable``."""

    def __init__(self, file, paths: dict):
        # ``persistent_id`` is asked of every object pickled (350,000 for the 32-layer model):
        # one dict lookup by id, bound before pickle's own ``__init__`` looks it up.
        self.paths = {**places.module_globals(), **paths, **places.keraunos_singletons()}
        self.persistent_id = functools.partial(_path_of, self.paths.get)
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: dict[int, _Storage] = {}  # a capture-time storage -> its stand-in

    def reducer_override(self, obj):
        t = type(obj)
        if t in _BY_VALUE:  # most objects: decided once per type
            return NotImplemented
        if t is TensorProxy:
            state = {s: getattr(obj, s) for s in _slots(t) if hasattr(obj, s)}
            del state["storage"]  # an address in this process: made again from ``_storage``
            if state.get("_storage") is not None:  # one stand-in per storage the proxies share
                state["_storage"] = self.storages.setdefault(state["_storage"]._cdata,
                                                             _Storage())
            return _tensor_proxy, (state,)
        if t is types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        if t is Symbols:
            # A capture's size symbols (the prologue's CHECK_SIZES line): with none, as the
            # checks they print (none); otherwise with their ShapeEnv (below).
            if not obj.bindings and not list(obj.checks()):
                return _NoSymbols, ()
            return _symbols, (obj.env, obj.names, obj.bindings, obj._printer.names)
        if t is ShapeEnv:
            return _shape_env, _shape_env_facts(obj)
        if t in _SYMBOLIC:  # a SymInt of a trace: its expression, on the rebuilt ShapeEnv
            node = obj.node
            if not isinstance(node.shape_env, ShapeEnv) or node.hint is None:
                raise Unstorable(f"a {t.__name__} without a hint ({node._expr})")
            return _symbolic, (t, node.shape_env, node._expr, node.pytype, node.hint)
        if t is SymbolicValue:  # ``2*s0`` in a trace: its text, its SymInt, its symbols
            return SymbolicValue, (str.__str__(obj), obj.value, obj.proxies)
        if t is ValueRanges:
            return ValueRanges, (obj.lower, obj.upper)
        if isinstance(obj, sympy.Basic):  # sympy's expressions pickle by value
            return NotImplemented
        reduced = self._live_reference(obj, t)
        if reduced is not None:
            return reduced
        return self._by_kind(obj, t)

    def _live_reference(self, obj, t: type):
        """Functions, descriptors, cells, weak references, loggers and global-state guards:
        how each is found again in a loading process (None: not one of them)."""
        if t is types.FunctionType:
            if places.findable(obj):
                return NotImplemented  # by name; pickle checks that it leads back to obj
            attribute = places.module_attribute(obj)
            if attribute is not None:  # ``torch.nn.functional.max_pool2d``, made by a factory
                return getattr, (importlib.import_module(obj.__module__), attribute)
            held = places.class_attribute(obj)
            if held is not None:  # ``torch.Tensor.__pow__``: a wrapper named for what it wraps
                return getattr, held
            steps = places.decorated(obj)
            if steps is not None:  # ``forward`` under a decorator: the name leads to its wrapper
                return places.undecorated, (obj.__module__, obj.__qualname__, steps)
            if not obj.__module__ or not obj.__module__.startswith("keraunos."):
                raise Unstorable(f"the function {obj.__qualname__} of {obj.__module__}")
            return _function_by_code, _function_state(obj)
        if t in _DESCRIPTORS:  # ``torch.Tensor.__add__``, ``torch.Tensor.grad``: by owner and name
            owner, name = obj.__objclass__, obj.__name__
            if vars(owner).get(name) is not obj:
                raise Unstorable(f"the descriptor {owner.__qualname__}.{name}")
            return getattr, (owner, name)
        if t is types.MethodWrapperType:
            return getattr, (obj.__self__, obj.__name__)
        if t is types.CellType:
            if not places.held_by_a_function(obj):
                # The cell of a function that is gone (one made by the call, or a wrapper since
                # replaced): nothing but this program can read or change it, so a cell of the
                # same contents does what it did.
                return places.cell_of, places.contents_of(obj)
            raise Unstorable("a closure cell of a function the program called (a generator "
                             "expression, lambda or nested function reading variables of the "
                             "program): another process has no such cell")
        if t is weakref.ReferenceType:
            target = obj()
            if target is not None and id(target) in self.paths:
                return weakref.ref, (target,)
            if type(target) in (torch.Tensor, torch.nn.Parameter):
                # A tensor of the call (a check's example): what a loading call's tensor
                # must be like to stand in for it (``_with_call_example``).
                return _TensorKind, (type(target), str(dispatch_keys(target)))
            return _dead_reference, ()
        if isinstance(obj, logging.Logger):
            # a logger whose calls the program replays (transformers' ``warning_once``): by
            # its name, as ``logging`` pickles it (an unnamed one raises, so is not kept)
            return obj.__reduce__()
        if t is GlobalStateGuard:
            return _global_state_guard, (obj.__getstate__(),)
        return None

    def _by_kind(self, obj, t: type):
        """Everything else: torch's values and C++ objects by name, plain values and keraunos's
        own records by value; anything else raises ``Unstorable``."""
        if isinstance(obj, torch.Tensor):
            raise Unstorable(f"a tensor that is not the module's ({type(obj).__qualname__})")
        if t in (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format) \
                or t.__module__ == "torch.return_types":  # ``topk``'s (values, indices)
            return NotImplemented
        if t is type and not places.findable(obj) and len(obj.__mro__) > 1 \
                and obj.__mro__[1].__qualname__ == obj.__qualname__:
            # capture's recording stand-in of a module class (``module_stack`` names it): the
            # class it stands in for
            return _identity, (obj.__mro__[1],)
        if t is types.BuiltinFunctionType and type(obj.__self__).__module__ == "pybind11_builtins":
            # torch's C++ functions bound with pybind11 (the C extension's ``_get_...``): by module and
            # name, where that leads back to the object
            module = sys.modules.get(obj.__module__ or "")
            if module is None or getattr(module, obj.__name__, None) is not obj:
                raise Unstorable(f"the C++ function {obj.__module__}.{obj.__name__}")
            return getattr, (module, obj.__name__)
        if t is OpOverload:  # by name, found again in ``torch.ops``
            return _op, (obj._schema.name, obj._overloadname)
        if t is OpOverloadPacket:
            return _op, (obj._qualified_op_name, None)
        if isinstance(obj, (type, types.BuiltinFunctionType)):
            return NotImplemented  # by name
        if t in _SIMPLE or t in (tuple, list, dict, set, frozenset, slice, range) \
                or isinstance(obj, (enum.Enum, pytree.TreeSpec)):  # (a replayed call's arguments)
            _BY_VALUE.add(t)
            return NotImplemented
        members = getattr(t, "__members__", None)  # a C++ enum of torch's (``DispatchKey``)
        if isinstance(members, dict) and members.get(getattr(obj, "name", None)) is obj:
            return getattr, (t, obj.name)
        module = getattr(t, "__module__", "") or ""
        if module.startswith("keraunos.") or t in (functools.partial, types.MethodType):
            if t.__name__ != "Symbols":  # every instance of these pickles by value
                _BY_VALUE.add(t)
            return NotImplemented
        raise Unstorable(f"an object of type {module}.{t.__qualname__}")


# Types whose every instance pickles by value as pickle does it (keraunos's records, containers,
# enums), found as the pickler meets them: the common case costs one set lookup.
_BY_VALUE: set[type] = set()

_DESCRIPTORS = (types.WrapperDescriptorType, types.MethodDescriptorType,
                types.GetSetDescriptorType, types.MemberDescriptorType,
                types.ClassMethodDescriptorType)


class _Unpickler(pickle.Unpickler):
    """Finds what ``places.paths_of`` named in the loading process's ``root`` (its module or its
    jitted function: a cell of the closure by its place)."""

    def __init__(self, file, root):
        super().__init__(file)
        self.module = root

    def persistent_load(self, pid):
        return places.resolve(pid, self.module)


class _NoSymbols:
    """The size symbols of a capture that made none: no checks."""

    bindings: dict = {}

    def checks(self) -> list:
        return []


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _shape_env_facts(env: ShapeEnv) -> tuple:
    """What a capture's ``ShapeEnv`` knows that its readers ask (the prologue's checks,
    ``Symbols.checks``; the fusion executor's region compiles): each symbol's capture-time value
    and range, the replacements, divisibility and guards, the symbols' ids, the traces' names."""
    return (dict(env.backed_var_to_val), dict(env.var_to_range), dict(env.replacements),
            set(env.divisible), [g.expr for g in env.guards], set(env.unique_ids),
            dict(getattr(env, "keraunos_names", {})))


def _shape_env(values, ranges, replacements, divisible, guards, ids, names) -> ShapeEnv:
    env = ShapeEnv()
    env.backed_var_to_val.update(values)
    env.var_to_range.update(ranges)
    env.replacements.update(replacements)
    # SymNode.expr applies the replacements only once their version moved (torch's cache)
    env._replacements_version_counter += 1
    env.divisible.update(divisible)
    where = SLoc("keraunos's program store", None)
    env.guards.extend(ShapeGuard(expr, where, False) for expr in guards)
    env.unique_ids.update(ids)  # a symbol made later gets an id of its own
    env.keraunos_names = names
    return env


def _symbolic(t: type, env: ShapeEnv, expr, pytype: type, hint):
    from torch.fx.experimental.sym_node import SymNode
    return t(SymNode(expr, env, pytype, hint))


def _symbols(env: ShapeEnv, names, bindings: dict, printed: dict) -> Symbols:
    """A capture's ``Symbols`` on its rebuilt ``ShapeEnv``: what the prologue's checks and the
    traces' printing read (no fake mode: nothing is captured with it again)."""
    symbols = Symbols.__new__(Symbols)
    symbols.fake_mode, symbols.env, symbols.names, symbols.bindings = None, env, names, bindings
    symbols._printer = SizePrinter(printed)
    return symbols


class _Storage:
    """A loaded proxy's storage: one object per storage the captured tensors shared, kept alive
    by the proxies, its ``_cdata`` (what passes compare) its own address, so that no live
    storage has it."""

    def __init__(self):
        self._cdata = id(self)

    def __reduce__(self):
        return _Storage, ()  # a new one on load (pickle's memo shares it between proxies)


class _TensorKind:
    """In a loaded tensor check, in place of the weak reference to the call's tensor it was
    compiled for (gone with that process): that tensor's class and dispatch keys. Called, it
    gives None, as a dead reference does."""

    def __init__(self, cls: type, keys: str):
        self.cls, self.keys = cls, keys

    def __call__(self):
        return None


def _with_call_example(line, value_of: dict):
    """A loaded tensor check whose compiled-for tensor was the call's: this call's tensor is its
    example when it is of that tensor's class and dispatch keys (an inference tensor of
    ``generate()`` is one, which no tensor made here would match); the readable prologue
    checked the rest."""
    kind = getattr(getattr(line, "fields", None), "real", None)
    if line.symbol is not glue.CHECK_TENSOR or type(kind) is not _TensorKind:
        return line
    tensor = value_of.get(line.args[0].name)
    if type(tensor) is not kind.cls or str(dispatch_keys(tensor)) != kind.keys:
        return line
    return line.replace(fields=replace(line.fields, real=weakref.ref(tensor)))


def _path_of(get, obj):
    return get(id(obj))


@functools.lru_cache(maxsize=None)
def _slots(t: type) -> tuple:
    return tuple(s for c in t.__mro__ for s in getattr(c, "__slots__", ()))


def _tensor_proxy(state: dict):
    proxy = TensorProxy.__new__(TensorProxy)
    for name, value in state.items():
        setattr(proxy, name, value)
    proxy.storage = proxy._storage._cdata if proxy._storage is not None else None
    return proxy


def _function_state(fn) -> tuple:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append((True, cell.cell_contents))
        except ValueError:
            cells.append((False, None))
    return (marshal.dumps(fn.__code__), fn.__module__, fn.__name__, fn.__qualname__,
            fn.__defaults__, fn.__kwdefaults__, tuple(cells))


def _function_by_code(code, module, name, qualname, defaults, kwdefaults, cells):
    closure = tuple(types.CellType(v) if full else types.CellType() for full, v in cells)
    fn = types.FunctionType(marshal.loads(code), vars(sys.modules[module]), name, defaults,
                            closure or None)
    fn.__qualname__, fn.__kwdefaults__ = qualname, kwdefaults
    return fn


def _op(qualified_name: str, overload: str | None):
    namespace, name = qualified_name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _identity(x):
    return x


def _dead_reference():
    return _DEAD


def _nothing():
    return None


_DEAD = _nothing  # a weak reference whose object is gone (called, it gives None)


def _global_state_guard(state: str):
    guard = GlobalStateGuard()
    guard.__setstate__(state)
    return guard


def dumps(value, paths: dict) -> bytes:
    """``value`` pickled against a module tree's ``paths`` (``places.paths_of``); raises
    ``Unstorable``."""
    f = io.BytesIO()
    try:
        _Pickler(f, paths).dump(value)
    except Unstorable:
        raise
    except Exception as e:  # noqa: BLE001 - pickle's own refusal of an object
        raise Unstorable(f"{type(e).__name__}: {e}") from None
    return f.getvalue()


def loads(data: bytes, root):
    return _Unpickler(io.BytesIO(data), root).load()


# ------------------------------------------------------------------------------ store access
def get(key: str) -> bytes | None:
    return store.default_store().get(NAMESPACE, key)


def put(key: str, data: bytes) -> None:
    store.default_store().put(NAMESPACE, key, data)


# ------------------------------------------------------------------------------- keep and load
_keeping: list = []  # background.Job of the programs being pickled
_keeping_lock = threading.Lock()


def keep_in_background(key: str, stored: StoredProgram, root, done: Callable[[str], None],
                       owner: object = None) -> None:
    """``keep`` in the background (``background.py``); ``done(note)`` when it is through. Where
    the objects the program refers to are (the module tree, or the jitted function's globals
    and closure, and the globals the prologue checks) is taken now, on the caller's thread: a
    module changed after this call is not seen, and the job walks no live object of the user's.
    ``owner`` (the jitted callable's state): deleting it drops the job if it has not started."""
    paths = places.paths_of(root)
    paths = {**paths, **places.guarded_objects(stored.prologue, root, paths)}
    # The traces hold live objects of the user's (the module, in the prologue's namespace):
    # held here only while ``owner`` lives, so that deleting the jitted callable frees them.
    box = {"stored": stored}
    if owner is not None:
        weakref.finalize(owner, box.clear)
    del stored

    def run():
        kept = box.pop("stored", None)
        if kept is not None:
            done(keep(key, kept, paths))
    job = background.submit(run, background.KEEP, owner)
    with _keeping_lock:
        _keeping[:] = [j for j in _keeping if not j.done.is_set()] + [job]


def wait_for_keeps(timeout: float | None = None) -> bool:
    """Wait until the programs being kept in the background are in the store (for tests and
    benchmarks); False if ``timeout`` seconds passed first."""
    with _keeping_lock:
        jobs = list(_keeping)
    deadline = None if timeout is None else time.perf_counter() + timeout
    for job in jobs:
        if not job.done.wait(None if deadline is None else max(0.0, deadline - time.perf_counter())):
            return False
    return True


def keep(key: str, stored: StoredProgram, paths: dict) -> str:
    """Keep ``stored`` (what ``keeping.program_to_keep`` collects) under
    ``key``, pickled against ``paths`` (``places.paths_of`` and ``places.guarded_objects``);
    says what happened (``compile_stats().program_store``)."""
    try:
        data = dumps(stored, paths)
    except Unstorable as e:
        return f"not kept: {e}"
    except Exception as e:  # noqa: BLE001 - the store must never stop a compilation
        return f"not kept: {type(e).__name__}: {e}"
    put(key, data)
    return "kept"


def _returning_every_checked_tensor(prologue: Trace) -> tuple[Trace, tuple]:
    """``prologue``, returning also the tensors it checks but does not hand on (a ``.grad`` the
    program sets before reading it: a load needs each checked tensor of the call); and what its
    return's first part then holds."""
    ret = prologue.bound_symbols[-1]
    handed = tuple(ret.args[0])
    names = {p.name for p in handed if isinstance(p, Proxy)}
    extra = tuple(dict.fromkeys(b.args[0] for b in prologue.bound_symbols
                                if b.symbol is glue.CHECK_TENSOR and b.args[0].name not in names))
    if not extra:
        return prologue, handed
    lines = prologue.bound_symbols[:-1] + [ret.replace(args=(handed + extra,) + ret.args[1:])]
    return Trace(prologue.name, list(prologue.params), lines, prologue.header,
                 prologue.namespace), handed + extra


def load(key: str, root, args: tuple, kwargs: dict) -> tuple[StoredProgram | None, str | None]:
    """What ``keep`` kept under ``key`` for ``root`` (the module, or the jitted function), with
    its readable prologue's tensor checks made from this call's tensors, when that prologue
    accepts the call, and None; else None and why a row that was there could not be used (None
    when nothing was kept under ``key``, or when its prologue rejects the call: a miss, as any
    entry's)."""
    data = get(key)
    if data is None:
        return None, None
    try:
        stored = loads(data, root)
        if type(stored) is not StoredProgram or stored.format != FORMAT:
            return None, "the row is not a stored program of this version"
        prologue = stored.prologue
        if isinstance(root, torch.nn.Module):
            # Module attributes are checked by identity with the objects compiled for: here
            # those of this process's module, where they have the stored values.
            prologue = Trace(prologue.name, list(prologue.params),
                             [expecting_values_of(b, root) for b in prologue.bound_symbols],
                             prologue.header, prologue.namespace)
        seeing, handed = _returning_every_checked_tensor(prologue)
        accepted = seeing.python_callable()(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a row that does not load is a miss
        return None, f"it did not load ({type(e).__name__}: {str(e)[:200]})"
    if type(accepted) is not tuple:  # a miss like any entry's: what it depends on changed
        return None, None
    value_of = {p.name: v for p, v in zip(handed, accepted[0]) if isinstance(p, Proxy)}
    lines = [with_example(_with_call_example(b, value_of), value_of)
             for b in prologue.bound_symbols]
    if any(b is None for b in lines):
        return None, "a tensor of the call is not like the one it was kept with"
    return replace(stored, prologue=Trace(
        prologue.name, list(prologue.params), lines,
        prologue.header + ["Loaded from keraunos's program store"], prologue.namespace)), None
