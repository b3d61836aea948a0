"""The native hit path: a jitted function's or module's hit in one C call (``hit_path.cpp``), for
the entries whose prologue it can express whole; every other entry keeps the Python hit path
(``runtime/call.py``).

What it serves: an entry whose fast prologue is made of these lines only

    if len(args) != N: ...            # N positional arguments, every one a tensor
    if kwargs: ...                    # no keywords
    if not _global_state.check(): ... # dynamo's GlobalStateGuard
    if _get_autocast_dtype(dev) is not ...; if _get_float32_matmul_precision() != ...
    if _is_inference_mode_enabled() is not ...
    x = args[0]; ...                  # each argument once, in order
    if not _tensor_guards.check(x): ...; s0 = x.shape[0]; if not (2 <= s0): ...
                                      # symbolic sizes: read from the arguments' sizes or
                                      # strides, their guards
    _s = _structure[0]; if _s[0] is not _tree_token[0]: ...   # a module's kept walk
    if _attribute_dicts[0]['training'] is not True: ...       # module attributes, by identity
    if not _tensor_guards.check(x, ...): ...   # every tensor's metadata in one C++ call
    return (x, *_s[1], s0), ()        # arguments, the module's static tensors, size symbols

with no alias check and an epilogue that hands back the computation's one output as it is
(``_plan`` decides all of it, from the entry and its fast prologue's record). Anything else in the prologue (other module or Python values,
aliasing, data-dependent sizes, dataclass or container arguments) leaves the entry on the Python
hit path: ``why_not(entry)`` says which line.

Why it accepts exactly the calls the Python hit path accepts: every line above but the
attribute checks, the settings and the module walk's token is a function of values the first
accepted call records (``Armed`` in ``hit_path.cpp``: the global settings ``GlobalStateGuard``
serializes, ``GLOBAL_STATE_FIELDS``; each tensor's type, dispatch keys, dtype, device,
requires_grad, sizes and strides, the arguments' and the module's parameters' and buffers'), so
a later call with the very same values is accepted without them. The rest is read on every
call: the settings from the C++ getters behind the prologue's calls
(``at::autocast::get_autocast_dtype``, ``at::globalContext().float32MatmulPrecision()``,
``c10::InferenceMode::is_enabled()``; any ``Ambient`` it does not know keeps the entry in Python,
``Ambient.native``, and a test fails when ``AMBIENT_STATE`` grows), the walk's token and
attributes from the prologue's own ``_structure`` and ``_tree_token`` lists (a changed tree: the
Python path walks it again). A call whose values differ is decided by the checks themselves: for
a function's static entry the prologue's own ``GlobalStateGuard`` and ``TensorGuards`` objects,
called through their C functions with the same arguments; for the others the prologue itself,
called from C, whose inputs the computation then takes (and when the inputs built from the
recorded sources are exactly those the prologue returned, the call's values are recorded in
place of the old). What it rejects, or a call with keywords, goes to the Python ``__call__``,
which runs the Python hit path and explains a miss as before.

The build: ``hit_path.cpp`` is compiled once per source, torch and Python version into
``cache_directory()`` (a temporary name renamed into place, so never half-written), on the
first ``keraunos.jit`` in the background (about 10 s of one core); until it loads, and forever
where it cannot be built (no compiler, a failed build: one debug log line), calls take the
Python path (a failed compile is not tried again for a day: ``recent_failure``). ``KERAUNOS_NATIVE=0`` turns it off; ``scripts/setup.sh`` builds it ahead
(``python -m keraunos.runtime.native``).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import json
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from ... import background
from ... import debug
from ...capture.ambient import AmbientDifference, NativeRead
from ...capture.guards import KEYS, LENGTH
from ...core import glue
from ...core.symbols import CodeWriter
from ..cache import returns_the_only_output, sharing_cannot_matter
from ..fast_prologue import STATICS, AttributeCheck, FastPrologue, LoadStructure, TensorChecks
from ...torch_internals import dispatch, dynamo

SOURCE = pathlib.Path(__file__).with_name("hit_path.cpp")
MODULE_NAME = "_keraunos_hit_path"  # the name its PyInit_ function carries

# The ambient settings a prologue may compare in Python that the native hit reads itself are
# those with a ``NativeRead`` (``capture/ambient.py``); those in dynamo's GlobalStateGuard and
# those the tensor checks imply need nothing of their own.
_MATMUL_PRECISIONS = {"highest": 0, "high": 1, "medium": 2}  # at::Float32MatmulPrecision
# What dynamo's GlobalStateGuard may compare (its serialized fields, in every supported torch
# release: ``torch_internals.dynamo``): the native hit records the values these depend on to skip
# calling it (hit_path.cpp, ``Armed``); a torch whose guard compares anything else keeps its
# entries on the Python hit path. ``allow_tf32`` (to 2.14) and ``cuda_matmul_precision`` (from
# 2.15) both derive from the CUDA matmul float32 precision, which ``Armed`` records.
GLOBAL_STATE_FIELDS = dynamo.GLOBAL_STATE_FIELDS
AUTOCAST_FIELDS = dynamo.AUTOCAST_FIELDS


# ------------------------------------------------------------------------------- the build
def enabled() -> bool:
    return os.environ.get("KERAUNOS_NATIVE", "1") not in ("", "0")


def cache_directory() -> pathlib.Path:
    """``$KERAUNOS_NATIVE_DIR``, else ``$XDG_CACHE_HOME/keraunos-native``, else
    ``~/.cache/keraunos-native``: apart from the program store (``persist/store.py``), whose directory
    tests point at a fresh one per run, so that the extension is built once per machine."""
    if os.environ.get("KERAUNOS_NATIVE_DIR"):
        return pathlib.Path(os.environ["KERAUNOS_NATIVE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "keraunos-native"


def _torch_paths() -> tuple[str, str]:
    root = os.path.dirname(torch.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


def _command(compiler: str, output: str) -> list[str]:
    include, lib = _torch_paths()
    abi = dispatch.cxx11_abi()
    return [compiler, "-O2", "-std=c++20", "-fPIC", "-shared", "-w", str(SOURCE),
            f"-I{sysconfig.get_paths()['include']}", f"-I{include}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{lib}", "-lc10", "-ltorch_cpu",
            "-ltorch_python", f"-Wl,-rpath,{lib}", "-o", output]


def library_path() -> pathlib.Path:
    """Where the built extension is kept: named by a digest of its source, the command that
    builds it, torch's version and Python's, so a change of any builds a new one."""
    key = hashlib.sha256(SOURCE.read_bytes())
    flags = [f for f in _command("c++", "out") if f != str(SOURCE)]  # any checkout: one build
    key.update(" ".join(flags).encode())
    key.update(f"{torch.__version__} {sys.version} {sys.platform}".encode())
    return cache_directory() / f"{MODULE_NAME}-{key.hexdigest()[:16]}.so"


def build() -> pathlib.Path:
    """Compile the extension into ``library_path()`` unless it is there; raise on failure."""
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="building-") as folder:
        output = os.path.join(folder, target.name)
        done = subprocess.run(_command(compiler, output), capture_output=True, text=True)
        if done.returncode != 0:
            message = (f"{compiler} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout).strip()[-2000:]}")
            _failure_marker(target).write_text(message)  # not tried again for a day
            raise RuntimeError(message)
        os.replace(output, target)  # atomic: another process sees all of it or nothing
    return target


FAILED_BUILD_RETRY_SECONDS = 24 * 3600


def _failure_marker(target: pathlib.Path) -> pathlib.Path:
    return target.with_suffix(".failed")


def recent_failure(target: pathlib.Path) -> str | None:
    """Why the last build of ``target`` failed, when it failed less than a day ago (a compile
    error is not retried by every process; a missing compiler is looked for each time)."""
    marker = _failure_marker(target)
    try:
        if time.time() - marker.stat().st_mtime < FAILED_BUILD_RETRY_SECONDS:
            return marker.read_text()
    except OSError:
        pass
    return None


def _remove_abandoned_builds(folder: pathlib.Path) -> None:
    """The temporary folders of builds a process left behind (it exited mid-build: the build
    runs on a daemon thread), an hour after they were made."""
    for old in folder.glob("building-*"):
        try:
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def _import(path: pathlib.Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class _Loader:
    """The extension's state in this process: not asked for yet, building in the background,
    loaded, or failed (for good: the Python path serves every call).

    The build (a g++ child) is a background job (``background.py``); the extension is imported,
    and the jitted callables waiting for it get their native front, on a user's thread: at the
    first ``start`` or ``poll`` after the build (a cache miss polls, and so does the switch to a
    fused tier), never on the build's thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.module = None
        self.failed: str | None = None
        self.job = None  # the background build, once started
        self.built: pathlib.Path | None = None  # what the build made, not imported yet
        # Callables waiting for the module: (weak reference to an object, what to call with it).
        self.waiting: list[tuple[weakref.ref, Callable]] = []
        self.build_seconds: float | None = None

    def start(self, wait: bool = False):
        """The module if it is loaded, or loads it now when it is built; otherwise starts the
        build in the background (or runs it, with ``wait``) and returns None."""
        if self.module is not None or self.failed is not None:
            return self.module
        with self.lock:
            if self.module is not None or self.failed is not None:
                return self.module
            if not enabled():
                self.failed = "KERAUNOS_NATIVE=0"
                return None
            try:
                path = library_path()
                if path.exists():
                    self.module = _import(path)
                    return self.module
                failure = recent_failure(path)
                if failure is not None:
                    self.failed = f"its build failed less than a day ago: {failure}"
                    debug.logger.debug("keraunos: the native hit path is not available, calls "
                                       "take the Python hit path: %s (delete %s to retry)",
                                       self.failed, _failure_marker(path))
                    return None
            except Exception as e:  # noqa: BLE001 - a stale or foreign file: build anew
                debug.logger.debug("keraunos: the native hit path did not load (%s: %s); "
                                   "building it again", type(e).__name__, e)
            if self.job is None:
                self.job = background.submit(self._build, background.KEEP)
            job = self.job
        if wait:
            job.done.wait()
            self.poll()
        return self.module

    def _build(self) -> None:
        """In the background: the g++ build only."""
        start = time.perf_counter()
        try:
            self.built = build()
        except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the Python path
            self.failed = f"{type(e).__name__}: {e}"
            debug.logger.debug("keraunos: the native hit path is not available, calls take the "
                               "Python hit path: %s", self.failed)
            self.waiting = []
            return
        self.build_seconds = time.perf_counter() - start

    def poll(self) -> None:
        """On a user's thread: import the extension the background build made, if it is done,
        and give the waiting callables their native front."""
        if self.built is None or self.module is not None:
            return
        with self.lock:
            if self.module is not None:
                return
            try:
                self.module = _import(self.built)
            except Exception as e:  # noqa: BLE001 - the Python path serves every call
                self.failed = f"{type(e).__name__}: {e}"
                self.waiting = []
                return
            waiting, self.waiting = self.waiting, []
        for ref, then in waiting:
            obj = ref()
            if obj is not None:
                then(obj)

    def when_loaded(self, obj, then: Callable) -> None:
        """``then(obj)`` once the module is loaded: now if it is, later (at a ``poll`` on a
        user's thread) if it is being built, never if it cannot be."""
        module = self.start()
        if module is not None:
            then(obj)
            return
        with self.lock:
            if self.module is None and self.failed is None:
                self.waiting.append((weakref.ref(obj), then))
                return
        if self.module is not None:
            then(obj)


LOADER = _Loader()


def module():
    """The loaded extension, or None (not built yet, or not available)."""
    return LOADER.module


# --------------------------------------------------------------------- which entries it serves
def why_not(entry) -> str | None:
    """Why the native hit path cannot serve ``entry``'s prologue, or None when it can."""
    plan = _plan(entry)
    return plan if isinstance(plan, str) else None


def hit_for(entry):
    """``entry``'s ``Hit`` (what its prologue checks, in C), or, in words, why the native hit
    path cannot serve it: the one place that decides (``_plan``: its alias check, its epilogue,
    its fast prologue's record)."""
    loaded = LOADER.module
    if loaded is None:
        return unavailable()
    plan = _plan(entry)
    if isinstance(plan, str):
        return plan
    return loaded.Hit(**plan)


def unavailable() -> str:
    """Why the native hit path serves no call now (it is not loaded)."""
    if LOADER.failed is not None:
        return f"the native hit path is not available: {LOADER.failed}"
    if not enabled():
        return "the native hit path is off (KERAUNOS_NATIVE=0)"
    return "the native hit path is still being built (a background job)"


# Where each of the computation's inputs comes from (``Source`` in hit_path.cpp).
_ARG, _STATICS, _SIZE, _STRIDE = range(4)


@dataclass
class _Read:
    """What ``_read`` found in a fast prologue's lines, for ``Hit``."""

    nargs: int | None = None
    no_kwargs: bool = False
    global_guard: object = None
    tensors: TensorChecks | None = None
    autocast: list = field(default_factory=list)
    matmul: int = -1
    inference_mode: int = -1
    unpacked: dict = field(default_factory=dict)   # argument index -> name
    checked: list = field(default_factory=list)    # the tensors the prologue's C++ calls check
    symbols: object = None
    walked: LoadStructure | None = None
    attributes: list = field(default_factory=list)


def _read_ambient(read: _Read, description: AmbientDifference) -> str | None:
    """An ambient check, read into ``read``; or why the native path cannot make it."""
    ambient = description.ambient
    if ambient is None:
        read.global_guard = description.snapshot.cxx_guard
        return None
    value = description.compiled_value()
    if ambient.native is NativeRead.AUTOCAST_DTYPE and isinstance(value, torch.dtype):
        read.autocast.append((ambient.device, value))
    elif ambient.native is NativeRead.FLOAT32_MATMUL_PRECISION and value in _MATMUL_PRECISIONS:
        read.matmul = _MATMUL_PRECISIONS[value]
    elif ambient.native is NativeRead.INFERENCE_MODE and type(value) is bool:
        read.inference_mode = int(value)
    else:
        return f"the prologue compares {ambient.label} in Python"
    return None


def _read(lines) -> _Read | str:
    """Each of the fast prologue's lines (all but its return) read for ``Hit``; or, in words,
    the first one the native path cannot make."""
    read = _Read()
    for b in lines:
        symbol, fields = b.symbol, b.fields
        guard = getattr(fields, "guard", None)
        description = getattr(fields, "description", None)
        if symbol is glue.CHECK and guard is not None and guard.path.is_root:
            if guard.kind is LENGTH and guard.path.key == "args":
                read.nargs = guard.expected[1]
                continue
            if guard.kind is KEYS and guard.path.key == "kwargs" and not guard.expected[1]:
                read.no_kwargs = True
                continue
        if symbol is glue.CHECK and guard is None and isinstance(description, AmbientDifference):
            why = _read_ambient(read, description)
            if why is not None:
                return why
            continue
        path = getattr(fields, "path", None)
        if symbol is glue.UNPACK and path.is_item and path.parent is not None \
                and path.parent.is_root and path.parent.key == "args" \
                and type(path.key) is int and path.key not in read.unpacked:
            read.unpacked[path.key] = b.outputs.name
            continue
        # Symbolic sizes: each tensor's rank and static metadata in one TensorGuards call, its
        # sizes read into symbols, their guards; all of them functions of what ``Armed`` records.
        if symbol is glue.CHECK and getattr(fields, "tensor_guards", None) is not None:
            read.checked += [a.name for a in b.args]
            continue
        if symbol in (glue.CHECK_SYMBOLIC_TENSOR, glue.BIND_SYMBOL):
            continue
        if symbol is glue.CHECK_SIZES:
            if b.args or list(fields.symbols.checks()):
                read.symbols = fields.symbols
            continue
        made = fields.lines if symbol is glue.PYTHON else None
        if isinstance(made, LoadStructure):
            read.walked = made
        elif isinstance(made, AttributeCheck) and type(made.key) is str:
            read.attributes.append((made.index, made.key, made.expected))
        elif isinstance(made, TensorChecks):
            read.tensors = made
            read.checked += made.checked
        else:
            line = (b.symbol.format(b, CodeWriter({})) or [b.symbol.name])[0]
            return f"the prologue line {line.strip()[:80]!r}"
    return read


def _plan(entry):
    """The keyword arguments of the entry's ``Hit``; or, in words, why there is none."""
    if entry.alias_check is not sharing_cannot_matter or not entry.epilogue_traces \
            or not returns_the_only_output(entry.epilogue_traces[-1]):
        return "its inputs may share memory, or its epilogue has work of its own"
    made = entry.fast_prologue
    if not isinstance(made, FastPrologue) or entry.hit_trace is None:
        return "its prologue is not the fast prologue's"
    if made.pro_to_epi:
        return "the prologue hands the epilogue values of its own"
    read = _read(made.trace.bound_symbols[:-1])
    if isinstance(read, str):
        return read
    nargs, tensors, walked = read.nargs, read.tensors, read.walked
    names = [read.unpacked.get(i) for i in range(nargs or 0)]
    if nargs is None or not read.no_kwargs or read.global_guard is None:
        return "the prologue does not check the argument count, keywords and global state"
    fields = json.loads(read.global_guard.__getstate__())
    if not set(fields) <= GLOBAL_STATE_FIELDS or set(fields["autocast_state"]) != AUTOCAST_FIELDS:
        return f"this torch's GlobalStateGuard compares {sorted(fields)}"
    if not nargs or None in names or len(read.unpacked) != nargs:
        return "not every argument is unpacked once"
    if not set(names) <= set(read.checked):
        return "not every argument is a tensor checked by the prologue's C++ calls"
    sources = _sources(made.inputs, names, read.symbols, walked is not None)
    if isinstance(sources, str):
        return sources
    plan = dict(entry=entry, nargs=nargs, global_guard=None, tensor_guards=None,
                autocast_dtypes=tuple(read.autocast), matmul_precision=read.matmul,
                prologue=entry.prologue_fn, sources=sources,
                inference_mode=read.inference_mode, attributes=tuple(read.attributes))
    if walked is not None:
        plan["structure"], plan["tree_token"] = walked.cache, walked.tree_token
    elif read.attributes:
        return "module attributes are checked without the module walk"
    elif read.symbols is None and sources is None and tensors is not None \
            and type(tensors.guards) is dynamo.TensorGuards and tensors.checked == names:
        # A function's static entry: its two guards, called in C, decide what the record does
        # not (no Python at all).
        plan.update(global_guard=read.global_guard, tensor_guards=tensors.guards)
    return plan


def _sources(inputs: tuple, names: list[str], symbols, walked: bool):
    """Where each of the computation's inputs (the fast prologue's ``inputs``: names, and
    ``STATICS``) comes from, for ``Hit``: None when they are the arguments as they came."""
    if list(inputs) == names:
        return None
    arg_of = {name: i for i, name in enumerate(names)}
    sizes = {}
    if symbols is not None:
        for binding in symbols.bindings.values():
            tensor = binding.tensor
            if tensor is None or binding.prop not in ("size", "stride") \
                    or tensor.name not in arg_of:
                return f"the size symbol {binding.proxy.name} is read from {binding.where()}"
            kind = _SIZE if binding.prop == "size" else _STRIDE
            sizes[binding.proxy.name] = (kind, arg_of[tensor.name], binding.dim)
    sources = []
    for item in inputs:
        if item is STATICS and walked:
            sources.append((_STATICS, 0, 0))
        elif item in arg_of:
            sources.append((_ARG, arg_of[item], 0))
        elif item in sizes:
            sources.append(sizes[item])
        else:
            return f"the computation takes {item}"
    return tuple(sources)
