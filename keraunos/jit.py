"""The jitted callable: the call path, cache entries, and compilation on a miss.

Every call runs the three steps below, each a module-level function so that profilers see them
by name:

    entry, inputs, pro_to_epi = get_computation_and_inputs(jitted, args, kwargs)
    result = entry.computation_fn(*inputs)
    return maybe_call_epilogue(entry, result, pro_to_epi)

``get_computation_and_inputs`` tries the cache entries, most recently used first: an entry is
valid for a call when its prologue's checks pass and ``check_storage_aliases`` finds the inputs
share memory exactly as they did when it was compiled. On a miss it compiles a new entry.

There is no separate step that connects the result to autograd (the design's
``maybe_connect_to_autograd``): for an entry with a backward trace, ``computation_fn`` runs the
forward inside a ``torch.autograd.Function`` (``autograd/function.py``), because autograd records
a node only while the forward runs. Wrapping results after the fact would hand back new tensor
objects where the program returns its inputs, and eager returns the very objects.
"""
from __future__ import annotations

import enum
import functools
import operator
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import debug
from . import executors as executors_module
from .cache import CacheEntry, CacheMode
from .capture.state import _active, active_context
from .capture.symbolic import DynamicRequest
from .errors import CaptureError, DataDependentError, user_source
from .pipeline import compile_entry
from .transforms import Transform


@dataclass
class CompileStats:
    """Timings of the entry that ran last, in seconds, and the cache counters."""

    stages: dict[str, float]
    last_cache_lookup: float
    cache_hits: int
    cache_misses: int

    @property
    def compile_time(self) -> float:
        return sum(self.stages.values())

    def __str__(self) -> str:
        lines = [f"{name:>40}: {seconds * 1e3:8.2f} ms" for name, seconds in self.stages.items()]
        lines.append(f"{'total compile':>40}: {self.compile_time * 1e3:8.2f} ms")
        lines.append(f"{'last cache lookup':>40}: {self.last_cache_lookup * 1e6:8.2f} us")
        lines.append(f"{'cache hits / misses':>40}: {self.cache_hits} / {self.cache_misses}")
        return "\n".join(lines)


class Fallback(enum.Enum):
    """What ``keraunos.jit`` does when capture meets a Python decision on tensor data."""

    ERROR = "error"    # raise CaptureError, naming the line and torch.compile(backend="keraunos")
    DYNAMO = "dynamo"  # warn once and run through torch.compile(backend=keraunos.dynamo.backend())


@dataclass(frozen=True)
class JitOptions:
    """What ``keraunos.jit`` was asked for, checked once in ``jit()``: every later reader sees
    typed values (enums, executor objects), never the strings a user may pass."""

    executors: tuple                 # Executor objects, in order of preference; python last
    transforms: tuple[Transform, ...]
    cache: CacheMode
    max_cache_entries: int
    profile: bool
    specialize_data: bool
    fallback: Fallback
    dynamic: bool | None

    @classmethod
    def validated(cls, *, executors=None, transforms=None, cache="constant values",
                  max_cache_entries=8, profile=None, specialize_data=False, fallback="error",
                  dynamic=None) -> "JitOptions":
        for t in transforms or ():
            if not isinstance(t, Transform):
                raise TypeError(f"keraunos.jit: transforms must be keraunos.Transform instances, "
                                f"got {t!r}")
        if dynamic not in (None, True, False):
            raise ValueError(f"keraunos.jit: dynamic must be None, True or False, got {dynamic!r}")
        if max_cache_entries < 1:
            raise ValueError("keraunos.jit: max_cache_entries must be at least 1")
        return cls(tuple(executors_module.resolve(executors)), tuple(transforms or ()),
                   _member(CacheMode, cache, "cache"), max_cache_entries,
                   _profile_default() if profile is None else bool(profile),
                   bool(specialize_data), _member(Fallback, fallback, "fallback"), dynamic)


def _member(enum_type, value, what: str):
    """``value`` (a member or its string) as a member of ``enum_type``, or a clear error."""
    try:
        return enum_type(value)
    except ValueError:
        raise ValueError(f"keraunos.jit: {what} must be one of "
                         f"{[m.value for m in enum_type]}, got {value!r}") from None


def _profile_default() -> bool:
    return os.environ.get("KERAUNOS_PROFILE", "0") not in ("", "0")


class _JitState:
    """What a jitted callable holds: its program, options and cache."""

    def __init__(self, fn, module, options: JitOptions):
        self.options = options
        self.fn = fn
        self.module = module
        self.entries: list[CacheEntry] = []  # most recently used first; replaced, never mutated
        self.lock = threading.RLock()
        self.counter_lock = threading.Lock()  # cheaper than the RLock; held for one increment
        self.hits = 0
        self.misses = 0
        self.last_entry: CacheEntry | None = None
        self.last_lookup = 0.0
        self.last_miss_reasons: list[str] = []
        self.warned_recompiles = False
        self.warned_no_backward = False
        # Automatic dynamic: the sizes and ints of earlier compilations, by path (see
        # capture/symbolic.py); a value that changed is compiled as a symbol from then on.
        self.seen_sizes: dict = {}
        self.symbolic_fallbacks: list[str] = []  # why symbolic entries were compiled exactly

    @property
    def name(self) -> str:
        target = self.module if self.module is not None else self.fn
        return getattr(target, "__qualname__", None) or type(target).__qualname__


# --------------------------------------------------------------------------------- call path
def get_computation_and_inputs(state: _JitState, args: tuple, kwargs: dict):
    start = time.perf_counter()
    for i, entry in enumerate(state.entries):
        try:
            r = entry.prologue_fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            # A prologue that cannot even unpack this call (an object of the right class that
            # lacks an attribute the entry reads) means "not this entry", as a failed check
            # does: the next entries still get their turn, and the one that fits moves to the
            # front, so later such calls stay on this path. When none fits, the miss path
            # captures the program again, which raises the user's own error if there is one.
            continue
        if type(r) is tuple and check_storage_aliases(entry, r[0]):
            if i:
                _promote(state, entry)
            with state.counter_lock:  # += is no atomic operation: threads would lose counts
                state.hits += 1
            state.last_entry = entry
            state.last_lookup = time.perf_counter() - start
            return entry, r[0], r[1]
    return _miss(state, args, kwargs, start)


_is_alias_of = torch._C._is_alias_of


def check_storage_aliases(entry: CacheEntry, inputs: Sequence) -> bool:
    """Whether the tensor inputs share memory exactly as they did when ``entry`` was compiled.

    Sharing only matters for an input the program writes to, or when inputs shared memory when
    it was compiled (a program that only reads computes eager's values whatever its inputs
    share). Nothing about it is cached across calls: ``p.data = t``, ``set_`` and
    ``swap_tensors`` change a parameter's memory without any hook. A written input whose
    storage nothing else refers to shares it with nobody, which is cheap to ask; otherwise every
    tensor input, parameters and buffers included, is compared."""
    return entry.alias_check(inputs)


_storage_use_count = torch._C._storage_Use_Count


def _alone(t: torch.Tensor) -> bool:
    # Two references: the tensor's and the temporary storage object's.
    return _storage_use_count(t.untyped_storage()._cdata) <= 2


def _alias_check_for(entry: CacheEntry) -> Callable:
    """The cheapest check that is exact for this entry, decided once instead of on every call."""
    positions, written = entry.alias_positions, entry.written_positions
    if positions is None or (entry.alias_pattern is None and written == ()):
        return lambda inputs: True
    if len(positions) == 2 and entry.alias_pattern is None:
        a, b = positions
        return lambda inputs: not _is_alias_of(inputs[a], inputs[b])
    if entry.alias_pattern is None and written is not None:
        # The storage's use count counts tensor objects: one tensor passed in two places is
        # "alone" by it, so those places are compared by identity too (fuzzer 30:1326): when
        # the tensors at ``positions`` are distinct objects (one set of their ids, built in C),
        # no written one is passed twice; otherwise the full comparison decides.
        tensors_at, written_at = _items_at(positions), _items_at(written)
        others = {i: tuple(j for j in positions if j != i) for i in written}

        def check(inputs):
            for t in written_at(inputs):
                if not _alone(t):
                    return _alias_pattern(entry, inputs) is None
            if len(set(map(id, tensors_at(inputs)))) == len(positions):
                return True
            if any(inputs[j] is inputs[i] for i in written for j in others[i]):
                return _alias_pattern(entry, inputs) is None
            return True  # only inputs the program reads are passed twice
        return check
    return lambda inputs: _alias_pattern(entry, inputs) == entry.alias_pattern


def _items_at(positions: tuple) -> Callable:
    """``inputs -> tuple(inputs[i] for i in positions)``, in C."""
    if len(positions) == 1:
        i = positions[0]
        return lambda inputs: (inputs[i],)
    return operator.itemgetter(*positions)


def _alias_pattern(entry: CacheEntry, inputs: Sequence):
    return storage_alias_pattern([inputs[i] for i in entry.alias_positions])


_storage_id = torch._C._storage_id  # the StorageImpl: what _is_alias_of compares


def storage_alias_pattern(inputs: Sequence) -> tuple | None:
    """For each tensor, the index of the first one sharing its storage and its offset in it;
    ``None`` when nothing is shared (the common case, compared cheaply)."""
    if len(inputs) <= 4:  # a few tensors: compare them pairwise
        if not any(_is_alias_of(a, b) for i, a in enumerate(inputs) for b in inputs[i + 1:]):
            return None
    storages = list(map(_storage_id, inputs))  # one C loop: the hit path of writing modules
    if len(set(storages)) == len(storages):
        return None
    first: dict[int, int] = {}
    # Views at other offsets are different programs when the inputs are rebuilt from one storage.
    return tuple((first.setdefault(s, i), inputs[i].storage_offset())
                 for i, s in enumerate(storages))


def maybe_call_epilogue(entry: CacheEntry, result, pro_to_epi):
    return entry.epilogue_fn(result, pro_to_epi)


def call(state: _JitState, args: tuple, kwargs: dict):
    entry, inputs, pro_to_epi = get_computation_and_inputs(state, args, kwargs)
    result = entry.computation_fn(*inputs)
    return maybe_call_epilogue(entry, result, pro_to_epi)


def call_profiled(state: _JitState, args: tuple, kwargs: dict):
    """``call`` with each step inside a ``torch.profiler.record_function`` (and NVTX) range."""
    with _range("keraunos.get_computation_and_inputs"):
        entry, inputs, pro_to_epi = get_computation_and_inputs(state, args, kwargs)
    with _range("keraunos.computation"):
        result = entry.computation_fn(*inputs)
    with _range("keraunos.maybe_call_epilogue"):
        return maybe_call_epilogue(entry, result, pro_to_epi)


class _range:
    def __init__(self, name: str):
        self.name = name
        self.record = torch.profiler.record_function(name)

    def __enter__(self):
        self.record.__enter__()
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_pop()
        self.record.__exit__(*exc)


def _promote(state: _JitState, entry: CacheEntry) -> None:
    entries = state.entries
    if entry in entries:  # another thread may have replaced the list meanwhile
        state.entries = [entry] + [e for e in entries if e is not entry]


# ----------------------------------------------------------------------------------- misses
def explain(entry: CacheEntry, args: tuple, kwargs: dict) -> str | None:
    """Why ``entry`` does not fit this call, in words; ``None`` when it does."""
    try:
        r = entry.prologue_fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure to unpack is a reason
        return f"the prologue could not unpack the call: {type(e).__name__}: {e}"
    if type(r) is int:
        return f"check failed: {entry.check_descriptions[r]}"
    if type(r) is str:
        return f"check failed: {r}"
    if not check_storage_aliases(entry, r[0]):
        return (f"inputs share memory differently: compiled for alias pattern "
                f"{entry.alias_pattern}, called with {_alias_pattern(entry, r[0])}")
    return None


def _miss(state: _JitState, args: tuple, kwargs: dict, start: float):
    if active_context() is not None:  # called while capturing another program: inline it
        return _inline_entry(state), (args, kwargs), None
    with state.lock:
        reasons = []
        for entry in state.entries:  # another thread may have compiled it meanwhile
            reason = explain(entry, args, kwargs)
            if reason is None:
                r = entry.prologue_fn(*args, **kwargs)
                with state.counter_lock:
                    state.hits += 1
                state.last_entry = entry
                state.last_lookup = time.perf_counter() - start
                return entry, r[0], r[1]
            reasons.append(reason)
        state.last_miss_reasons = reasons
        with state.counter_lock:
            state.misses += 1
        try:
            entry = _compile(state, args, kwargs)
        except CaptureError as e:
            if state.options.fallback is not Fallback.DYNAMO or not isinstance(e, DataDependentError):
                raise
            entry = _dynamo_fallback_entry(state, e)
            state.entries = [entry]  # dynamo's guards decide from now on: it always hits
            state.last_entry = entry
            return entry, (args, kwargs), None
        debug.compiled(state, entry)  # KERAUNOS_DEBUG logging and trace files; history for reports
        r = entry.prologue_fn(*args, **kwargs)
        if type(r) is not tuple:
            raise AssertionError(f"keraunos: internal error: a freshly compiled prologue rejects "
                                 f"the call it was compiled for ({explain(entry, args, kwargs)})")
        if entry.alias_positions is not None:  # the tensors among the inputs (not sizes)
            positions = tuple(i for i in entry.alias_positions if isinstance(r[0][i], torch.Tensor))
            entry.alias_positions = positions if len(positions) > 1 else None
        if entry.alias_positions is not None:
            entry.alias_pattern = _alias_pattern(entry, r[0])
        entry.alias_check = _alias_check_for(entry)
        if state.options.cache is not CacheMode.NO_CACHING:
            _insert(state, entry)
        state.last_entry = entry
        state.last_lookup = time.perf_counter() - start
        return entry, r[0], r[1]


def _compile(state: _JitState, args: tuple, kwargs: dict) -> CacheEntry:
    """``compile_entry``, with the sizes and ints that vary between calls made symbolic.

    In ``cache="symbolic values"`` every size and int of the call is a symbol; in the default
    mode those the user marked dynamic and those that changed since an earlier compilation
    (automatic dynamic). When capture with symbols meets something it cannot handle yet, the
    entry is compiled with exact sizes instead; ``symbolic_fallbacks`` says why."""
    cache, dynamic = state.options.cache, state.options.dynamic
    if cache not in (CacheMode.CONSTANT_VALUES, CacheMode.SYMBOLIC_VALUES) or (
            dynamic is False and cache is CacheMode.CONSTANT_VALUES):
        return compile_entry(state, args, kwargs)
    request = DynamicRequest(cache is CacheMode.SYMBOLIC_VALUES or dynamic is True,
                             state.seen_sizes)
    _active.dynamic = request
    try:
        entry = compile_entry(state, args, kwargs)
    except Exception as e:  # noqa: BLE001 - exact sizes are the safe way for anything
        if not request.any_dynamic:
            raise
        # The last few only: a program that always falls back must not grow this list.
        state.symbolic_fallbacks = state.symbolic_fallbacks[-15:] + [f"{type(e).__name__}: {e}"]
        entry = None
    finally:
        _active.dynamic = None
    state.seen_sizes = {**state.seen_sizes, **request.updated}
    if entry is None:
        return compile_entry(state, args, kwargs)
    if request.changes:
        state.last_miss_reasons = state.last_miss_reasons + [
            f"{change}; recompiled with it symbolic" for change in request.changes]
    return entry


def _inline_entry(state: _JitState) -> CacheEntry:
    """An entry that runs the original program, so that an outer capture records its ops."""
    target = state.module if state.module is not None else state.fn
    return CacheEntry(lambda *a, **k: None, lambda args, kwargs: target(*args, **kwargs),
                      lambda result, _: result, [], [], [], [], [], None, {})


def _dynamo_fallback_entry(state: _JitState, error: CaptureError) -> CacheEntry:
    """An entry that runs the program through torch.compile with the keraunos backend, with
    this callable's executors and transforms; warns once, naming the line that forced it."""
    from .dynamo import backend  # imports torch._dynamo: only paid by programs that fall back
    target = state.module if state.module is not None else state.fn
    compiled = torch.compile(target, backend=backend(executors=state.options.executors,
                                                     transforms=state.options.transforms))
    state.dynamo_compiled = compiled  # keraunos.dynamo.last_traces(jitted) finds it here
    lines = str(error).splitlines()
    where = lines[0].removeprefix("keraunos cannot capture ")
    message = (f"keraunos.jit: {state.name} falls back to torch.compile(backend=\"keraunos\") "
               f"because of {where}\n  {lines[1].strip()}\n  The cost: dynamo's bytecode analysis "
               f"and guards on every call, and the program runs as several compiled subgraphs "
               f"split at graph breaks, with Python in between.")
    _warn_at_user_line(message, stacklevel=5)
    return CacheEntry(lambda *a, **k: ((a, k), None),
                      lambda args, kwargs: compiled(*args, **kwargs),
                      lambda result, _: result, [], [], [], [], [], None, {})


def _warn_at_user_line(message: str, stacklevel: int) -> None:
    """A warning attributed to the user's line that led here (or to the caller's frame)."""
    source = user_source()
    if source is None:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
    else:
        warnings.warn_explicit(message, UserWarning, source.filename, source.lineno)


def _insert(state: _JitState, entry: CacheEntry) -> None:
    entries = [entry] + state.entries
    limit = state.options.max_cache_entries
    if len(entries) > limit:
        entries = entries[:limit]
        if not state.warned_recompiles:
            state.warned_recompiles = True
            message = (
                f"keraunos: {state.name} keeps recompiling: its cache holds "
                f"{limit} entries (max_cache_entries) and the least recently "
                f"used one was dropped. Last reasons: {state.last_miss_reasons[:3]}. Python values "
                f"that change on every call (a step counter, a position) are compiled in as "
                f"constants; pass them as tensors instead.")
            _warn_at_user_line(message, stacklevel=3)
    state.entries = entries


# ------------------------------------------------------------------------- public wrappers
class JittedFunction:
    """A function compiled by ``keraunos.jit``; call it as you would the original."""

    def __init__(self, fn: Callable, options: JitOptions):
        self._keraunos = _JitState(fn, None, options)
        self._call = call_profiled if options.profile else call
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)

    def __repr__(self) -> str:
        return f"keraunos.jit({self._keraunos.fn!r})"


class JittedModule(torch.nn.Module):
    """A module compiled by ``keraunos.jit``. It shares the original's parameters and buffers
    (an optimizer built on either updates both) and forwards attribute access, ``state_dict``,
    ``train()``/``eval()`` and the rest to it."""

    def __init__(self, module: torch.nn.Module, options: JitOptions):
        super().__init__()
        self._orig_mod = module
        state = _JitState(module.forward, module, options)
        object.__setattr__(self, "_keraunos", state)
        object.__setattr__(self, "_call", call_profiled if options.profile else call)

    def __call__(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)

    forward = __call__

    def __getattr__(self, name: str):
        if name == "_orig_mod":
            return self._modules["_orig_mod"]
        value = getattr(self._modules["_orig_mod"], name)
        if name == "generate" and callable(value):
            return _generate_through(self, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        if name == "_orig_mod" or name == "training":
            super().__setattr__(name, value)
        else:
            setattr(self._orig_mod, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._orig_mod, name)

    def __repr__(self) -> str:
        return f"keraunos.jit({self._orig_mod!r})"

    def __dir__(self):
        return sorted(set(dir(self._orig_mod)) | set(super().__dir__()))

    # Container modules (Sequential, ModuleList, ModuleDict) index, measure and iterate as before.
    def __getitem__(self, index):
        return self._orig_mod[index]

    def __len__(self) -> int:
        return len(self._orig_mod)

    def __bool__(self) -> bool:  # a module is true even when it defines no __len__
        return True

    def __iter__(self):
        return iter(self._orig_mod)

    def __contains__(self, item) -> bool:
        return item in self._orig_mod

    # A copy is a jitted copy of the original, with an empty cache.
    def __deepcopy__(self, memo):
        import copy
        return JittedModule(copy.deepcopy(self._orig_mod, memo), self._keraunos.options)

    def __reduce__(self):
        return (_rejit, (self._orig_mod, self._keraunos.options))

    # The module's own views of its state, without the "_orig_mod." prefix.
    def state_dict(self, *args, **kwargs):
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._orig_mod.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self._orig_mod.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._orig_mod.parameters(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._orig_mod.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._orig_mod.buffers(recurse)

    def named_modules(self, *args, **kwargs):
        return self._orig_mod.named_modules(*args, **kwargs)

    def modules(self):
        return self._orig_mod.modules()

    def named_children(self):
        return self._orig_mod.named_children()

    def children(self):
        return self._orig_mod.children()

    def train(self, mode: bool = True):
        super().__setattr__("training", mode)
        self._orig_mod.train(mode)
        return self


def _generate_through(jitted: JittedModule, generate: Callable) -> Callable:
    """The original module's ``generate`` (Hugging Face's), with its calls of the module's forward
    routed through the compiled program while it runs: bound to the original, ``generate`` would
    call the original forward and silently run eagerly."""
    @functools.wraps(generate)
    def run(*args, **kwargs):
        orig = jitted._orig_mod
        if _top_level_hooks(orig):
            # generate calls the module, which runs its hooks, then the routed forward, whose
            # program was captured from a call of the module: the hooks would run twice.
            if not getattr(jitted._keraunos, "warned_generate_hooks", False):
                jitted._keraunos.warned_generate_hooks = True
                _warn_at_user_line(
                    f"keraunos: {jitted._keraunos.name}.generate runs eagerly: the module has "
                    f"forward or backward hooks of its own (or global ones), which the compiled "
                    f"program already runs. Jit the model without them, or remove the hooks.",
                    stacklevel=3)
            return generate(*args, **kwargs)
        with _forward_routed(jitted):
            return generate(*args, **kwargs)
    return run


_routing_lock = threading.Lock()


class _forward_routed:
    """While any thread is inside the jitted module's ``generate``, the original module's
    ``forward`` (in its ``__dict__``) runs the compiled program; the first thread in installs
    it, the last one out restores what was there (counted, so threads cannot interleave a
    save and a restore)."""

    def __init__(self, jitted: JittedModule):
        self.jitted = jitted

    def __enter__(self):
        state, orig = self.jitted._keraunos, self.jitted._orig_mod
        with _routing_lock:
            if getattr(state, "routing_depth", 0) == 0:
                state.saved_forward = orig.__dict__.get("forward")
                forward = orig.forward
                jitted = self.jitted

                def compiled_forward(*a, **k):  # capture itself calls the module: the original
                    if active_context() is not None:
                        return forward(*a, **k)
                    return jitted._call(jitted._keraunos, a, k)
                orig.__dict__["forward"] = functools.wraps(forward)(compiled_forward)
            state.routing_depth = getattr(state, "routing_depth", 0) + 1

    def __exit__(self, *exc):
        state, orig = self.jitted._keraunos, self.jitted._orig_mod
        with _routing_lock:
            state.routing_depth -= 1
            if state.routing_depth == 0:
                if state.saved_forward is None:
                    orig.__dict__.pop("forward", None)
                else:
                    orig.__dict__["forward"] = state.saved_forward


_GLOBAL_CALL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


def _top_level_hooks(module: torch.nn.Module) -> bool:
    """Whether calling the module runs hooks around its forward (its own or global ones)."""
    modules = torch.nn.modules.module
    return any(getattr(modules, name, None) for name in _GLOBAL_CALL_HOOKS) or any(
        module.__dict__.get(name) for name in _CALL_HOOKS)


def _rejit(module, options):
    return JittedModule(module, options)


def jit(fn_or_module: Callable | torch.nn.Module, *, executors: Sequence | None = None,
        transforms: Sequence[Transform] | None = None, cache: str | CacheMode = "constant values",
        max_cache_entries: int = 8, profile: bool | None = None,
        specialize_data: bool = False, fallback: str | Fallback = "error",
        dynamic: bool | None = None):
    """Compile a function of tensors or an ``nn.Module``; the result is called like the original.

    The first call captures the program into traces, transforms and compiles them, and caches the
    result; later calls run a prologue that checks the inputs and reuse the cached program, or
    compile a new entry when a check fails.

    >>> import torch, keraunos
    >>> jf = keraunos.jit(lambda x, y: torch.nn.functional.gelu(x @ y + 1).sum(-1))
    >>> x, y = torch.randn(4, 8), torch.randn(8, 8)
    >>> torch.testing.assert_close(jf(x, y), torch.nn.functional.gelu(x @ y + 1).sum(-1))
    >>> print(keraunos.last_traces(jf)[-1])  # doctest: +SKIP

    Args:
        executors: who runs the operations, in order of preference (names or ``Executor``s);
            default ``["torch"]``.
        transforms: ``keraunos.Transform`` instances whose hooks run at fixed points.
        cache: ``"constant values"`` (default: sizes and Python numbers are compiled in and
            checked; a size or int that changes between calls is compiled as a symbol on the next
            compilation, so one more entry serves all its later values), ``"symbolic values"``
            (every size and int argument is a symbol from the first call on; the prologue checks
            the guards the capture recorded), ``"same input"`` or ``"no caching"``.
        max_cache_entries: entries kept per jitted callable; past it the least recently used goes.
        profile: wrap each call step in a profiler range (default: ``KERAUNOS_PROFILE=1``).
        specialize_data: instead of raising ``CaptureError`` when the program reads a Python value
            from tensor data (``.item()``, ``if t.any():``), compute it from the inputs in the
            prologue on every call: compiled in as a constant and checked (a new value
            recompiles), except an int whose value changed between compilations (or any int, in
            ``cache="symbolic values"``), which becomes a size symbol, its decisions guards (a
            position in a KV cache: one entry while the window fills, one once it is full).
        dynamic: in the default cache mode, ``None`` (default) compiles a size or int argument
            that changed between calls as a symbol (automatic dynamic); ``False`` never does (one
            entry per set of sizes); ``True`` makes every size and int argument a symbol from the
            first call on, as ``cache="symbolic values"`` does.
        fallback: on such a decision (without ``specialize_data``), ``"error"`` (default) raises
            ``CaptureError`` naming the line; ``"dynamo"`` warns once and runs the program through
            ``torch.compile(backend="keraunos")`` instead (graph breaks at such decisions).
    """
    if isinstance(fn_or_module, (JittedFunction, JittedModule)):
        raise TypeError("keraunos.jit: this callable is already jitted")
    if not callable(fn_or_module):
        raise TypeError(f"keraunos.jit: expected a function or an nn.Module, got "
                        f"{type(fn_or_module).__qualname__}")
    options = JitOptions.validated(
        executors=executors, transforms=transforms, cache=cache,
        max_cache_entries=max_cache_entries, profile=profile, specialize_data=specialize_data,
        fallback=fallback, dynamic=dynamic)
    if isinstance(fn_or_module, torch.nn.Module):
        jitted = JittedModule(fn_or_module, options)
        for t in options.transforms:
            t.transform_module(jitted)
        return jitted
    return JittedFunction(fn_or_module, options)


def state_of(jitted) -> _JitState:
    try:
        return jitted._keraunos
    except AttributeError:
        raise TypeError(f"expected a callable returned by keraunos.jit, got {jitted!r}") from None

