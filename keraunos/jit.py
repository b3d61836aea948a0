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
import inspect
import operator
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from . import debug
from . import executors as executors_module
from .cache import CacheEntry, CacheMode
from .capture.leaks import capture_values_in
from .capture.state import _active, active_context
from .capture.symbolic import DynamicRequest
from .errors import FALLBACK_ERRORS, CaptureError, DataDependentError, user_source
from .pipeline import compile_entry
from .transforms import Transform


@dataclass
class CompileStats:
    """Timings of the entry that ran last, in seconds, and the cache counters.

    ``last_cache_lookup`` is what the last call's cache lookup cost: on a hit, the prologue
    checks up to the entry that accepted the call; on a miss (``last_call_compiled``), the
    checks that failed, without the compilation that followed (``compile_time``)."""

    stages: dict[str, float]
    last_cache_lookup: float
    cache_hits: int
    cache_misses: int
    last_call_compiled: bool = False

    @property
    def compile_time(self) -> float:
        return sum(self.stages.values())

    def __str__(self) -> str:
        return debug.format_compile_stats(self)


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
                  max_cache_entries=8, profile=None, specialize_data=False, fallback="dynamo",
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
        self.compiled_at_call = 0  # hits + misses when the last miss happened
        self.last_miss_reasons: list[str] = []
        self.warned_recompiles = False
        self.warned_no_backward = False
        # Automatic dynamic: the sizes and ints of earlier compilations, by path (see
        # capture/symbolic.py); a value that changed is compiled as a symbol from then on.
        self.seen_sizes: dict = {}
        self.symbolic_fallbacks: list[str] = []  # why symbolic entries were compiled exactly
        self.warned_transform = False  # called under a torch.func transform: warned once

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


def _call_checking_results(state: _JitState, args: tuple, kwargs: dict):
    """``call``, then a search of the result for capture's FakeTensors, which must never reach
    the user (on with ``KERAUNOS_CHECK_RESULTS=1``; the test suite runs with it)."""
    result = _call_unchecked(state, args, kwargs)
    if active_context() is not None:  # called while capturing another program: inlined, fake
        return result
    found = capture_values_in(result)
    if found is not None:
        raise AssertionError(f"keraunos internal error: {found} is a FakeTensor made during "
                             f"capture, handed back by a call of {state.fn!r}")
    return result


_call_unchecked = call
if os.environ.get("KERAUNOS_CHECK_RESULTS", "0") not in ("", "0"):
    call = _call_checking_results


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
        description = entry.check_descriptions[r]
        live = getattr(description, "explain_miss", None)  # ambient.AmbientDifference
        return f"check failed: {live() if live is not None else description}"
    if type(r) is str:
        return f"check failed: {r}"
    if not check_storage_aliases(entry, r[0]):
        return (f"inputs share memory differently: compiled for alias pattern "
                f"{entry.alias_pattern}, called with {_alias_pattern(entry, r[0])}")
    return None


def _miss(state: _JitState, args: tuple, kwargs: dict, start: float):
    if active_context() is not None:  # called while capturing another program: inline it
        return _inline_entry(state), (args, kwargs), None
    if _under_function_transform(args, kwargs):
        return _eager_under_transform(state), (args, kwargs), None
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
        lookup = time.perf_counter() - start  # what the failed checks cost, before compiling
        with state.counter_lock:
            state.misses += 1
            state.compiled_at_call = state.hits + state.misses  # compile_stats: this call missed
        try:
            entry = _compile(state, args, kwargs)
        except CaptureError as e:
            if state.options.fallback is not Fallback.DYNAMO or not isinstance(
                    e, FALLBACK_ERRORS):
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
        state.last_lookup = lookup
        return entry, r[0], r[1]


def _compile(state: _JitState, args: tuple, kwargs: dict) -> CacheEntry:
    """``_compile_exact_or_symbolic`` without the caller's saved-tensor hooks: a jitted call
    inside ``torch.utils.checkpoint`` (non-reentrant) compiles in its forward, and the ops of
    compilation (the autograd split's own autograd runs) must not be packed as the checkpointed
    forward's saved tensors, nor hit the recomputation's early stop."""
    if state.module is not None and not getattr(state, "forward_only", False):
        _refuse_sharded_units_inside(state.module)
    stashed = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        stashed.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        return _compile_exact_or_symbolic(state, args, kwargs)
    finally:
        for pack, unpack in reversed(stashed):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _compile_exact_or_symbolic(state: _JitState, args: tuple, kwargs: dict) -> CacheEntry:
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


_is_functorch_tensor = torch._C._functorch.is_functorch_wrapped_tensor


def _under_function_transform(args: tuple, kwargs: dict) -> bool:
    """Whether the call's tensors are torch.func's wrappers (``torch.func.grad(jitted)(x)``):
    no prologue accepts them (their dispatch keys differ), and capture cannot take them in."""
    return any(isinstance(x, torch.Tensor) and _is_functorch_tensor(x)
               for x in pytree.tree_leaves((args, kwargs)))


def _eager_under_transform(state: _JitState) -> CacheEntry:
    """The program as it is, for a call under a torch.func transform (warned once)."""
    if not state.warned_transform:
        state.warned_transform = True
        _warn_at_user_line(
            f"keraunos.jit: {state.name} is called under a torch.func transform (grad, vmap, "
            f"jacrev, ...): such calls run the original program eagerly, not the compiled one "
            f"(nothing is cached for them). To compile it, jit the transformed function instead: "
            f"keraunos.jit(torch.func.grad(f)) falls back to torch.compile(backend=\"keraunos\"), "
            f"which traces the transform.", stacklevel=4)
    return _inline_entry(state)


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
               f"split at graph breaks, with Python in between.\n  To keep the whole program in "
               f"one trace: keep such decisions in tensors (torch.where, masks), pass the value "
               f"in as a Python argument, or let keraunos.jit(..., specialize_data=True) compute "
               f"it in the prologue; keraunos.jit(..., fallback=\"error\") raises instead of "
               f"falling back.")
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
    ``train()``/``eval()`` and the rest to it.

    It presents the original's interface to libraries that inspect a model:

    - ``forward`` and ``__call__`` carry the original ``forward``'s signature
      (``inspect.signature(jitted.forward)`` lists ``input_ids, attention_mask, labels, ...``),
      and the jitted module's class is a subclass of ``JittedModule`` made per original class,
      whose ``__name__`` and ``forward`` signature are the original's (Hugging Face's ``Trainer``
      derives its dataset columns and label names from them; ``type(jitted).__qualname__`` reads
      ``JittedModule[Original]``).
    - The methods rule: any other method of the original (``predict``, ``encode``, ``generate``)
      runs with the original's ``forward`` routed through the compiled program, so a method that
      calls ``self(...)`` or ``self.forward(...)`` hits the cache as a call of the jitted module
      does. Outside such a call the original module stays as it was: calling it runs eagerly.
    - As a submodule of another module, its state dict has the original's keys (no
      ``_orig_mod.``), and loads from them.
    """

    def __new__(cls, module: torch.nn.Module, options: JitOptions):
        if cls is JittedModule:
            cls = _jitted_class(module)
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module, options: JitOptions):
        super().__init__()
        self._orig_mod = module
        state = _JitState(module.forward, module, options)
        object.__setattr__(self, "_keraunos", state)
        object.__setattr__(self, "_call", call_profiled if options.profile else call)
        self.register_load_state_dict_pre_hook(_keys_of_the_original)

    def __call__(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)

    forward = __call__

    def __getattr__(self, name: str):
        if name == "_orig_mod":
            return self._modules["_orig_mod"]
        orig = self._modules["_orig_mod"]
        value = getattr(orig, name)
        if inspect.ismethod(value) and value.__self__ is orig:
            return _through_compiled_forward(self, name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # ``__class__``: a library that extends the wrapper's class (``fully_shard`` swaps in
        # ``FSDP<cls>``) means the wrapper, not the original.
        if name == "_orig_mod" or name == "training" or name == "__class__":
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

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """The original's modules; the wrapper itself comes first, at the same name, once a
        composable distributed API (``fully_shard``, ``replicate``, ``checkpoint``) holds
        state on it: FSDP2's root finds every unit's state by walking ``named_modules()``."""
        if _composable_state_on(self):
            if memo is None:
                memo = set()
            if self not in memo:
                if remove_duplicate:
                    memo.add(self)
                yield prefix, self
        yield from self._orig_mod.named_modules(memo, prefix, remove_duplicate)

    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_children(self):
        return self._orig_mod.named_children()

    def children(self):
        return self._orig_mod.children()

    def train(self, mode: bool = True):
        super().__setattr__("training", mode)
        self._orig_mod.train(mode)
        return self

    # Call hooks registered on the wrapper itself (FSDP2's all-gather and reshard, a
    # composable checkpoint's, the user's) run around the compiled program: the first one
    # registered switches the wrapper to a class whose ``__call__`` is ``nn.Module.__call__``
    # (hooks, then ``forward``, the compiled program). Without any, ``__call__`` stays the
    # direct call of the program. Hooks of the original module are part of the program.
    def register_forward_pre_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_forward_pre_hook(*args, **kwargs)

    def register_forward_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_forward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_full_backward_pre_hook(*args, **kwargs)

    def register_full_backward_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_full_backward_hook(*args, **kwargs)

    def register_backward_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_backward_hook(*args, **kwargs)


_jitted_classes: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _jitted_class(module: torch.nn.Module) -> type:
    """The ``JittedModule`` subclass for ``module``: its ``forward`` and ``__call__`` take the
    original ``forward``'s signature and its ``__name__`` is the original class's, because
    libraries read both off a model (Hugging Face's ``Trainer`` keeps only the dataset columns
    that ``forward`` names, and finds label names in ``type(model).forward``). One per original
    class, or one per module whose instance has a ``forward`` of its own."""
    cls = type(module)
    own_forward = "forward" in module.__dict__
    if not own_forward and cls in _jitted_classes:
        return _jitted_classes[cls]

    def forward(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)
    forward.__signature__ = _signature_with_self(module.forward)
    forward.__doc__ = getattr(module.forward, "__doc__", None)
    forward.__qualname__ = f"JittedModule[{cls.__qualname__}].forward"
    jitted_cls = type(cls.__name__, (JittedModule,), {
        "forward": forward, "__call__": forward, "__module__": __name__,
        "__qualname__": f"JittedModule[{cls.__qualname__}]", "__doc__": JittedModule.__doc__})
    if not own_forward:
        _jitted_classes[cls] = jitted_cls
    return jitted_cls


_hooked_classes: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _run_call_hooks(jitted: JittedModule) -> None:
    """Switches ``jitted`` to its class's variant whose ``__call__`` runs ``nn.Module``'s call
    hooks (once; a class that already does, e.g. ``FSDP<...>`` built on it, stays)."""
    cls = type(jitted)
    if cls.__call__ is torch.nn.Module.__call__:
        return
    hooked = _hooked_classes.get(cls)
    if hooked is None:
        hooked = type(cls.__name__, (cls,), {
            "__call__": torch.nn.Module.__call__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _hooked_classes[cls] = hooked
    object.__setattr__(jitted, "__class__", hooked)


def _composable_state_on(module: torch.nn.Module) -> bool:
    """Whether a composable distributed API (``torch.distributed._composable.contract``:
    ``fully_shard``, ``replicate``, ``checkpoint``) was applied to ``module`` itself."""
    contract = sys.modules.get("torch.distributed._composable.contract")
    return contract is not None and bool(module.__dict__.get(contract.REGISTRY_KEY))


def _signature_with_self(bound_forward: Callable) -> inspect.Signature:
    """``bound_forward``'s signature with a ``self`` parameter first, as a method defines it."""
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    try:
        signature = inspect.signature(bound_forward)
    except (TypeError, ValueError):  # a forward defined in C: no signature to show
        return inspect.Signature([self_param,
                                  inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                                  inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    if "self" in signature.parameters:  # a forward with a parameter named self: keep it visible
        self_param = self_param.replace(name="_jitted_self")
    return signature.replace(parameters=[self_param, *signature.parameters.values()])


def _keys_of_the_original(module, state_dict, prefix, *_):
    """Loading a jitted submodule: the state dict holds the original's keys (``prefix +
    'fc.weight'``, as ``state_dict`` writes them and an eager model's checkpoint holds them),
    while ``load_state_dict`` walks ``_modules`` and looks for ``prefix + '_orig_mod.fc.weight'``:
    rename them in place."""
    inner = prefix + "_orig_mod."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _through_compiled_forward(jitted: JittedModule, name: str, method: Callable) -> Callable:
    """The original module's ``method`` (``generate``, ``predict``, ``encode``...), with its calls
    of the module (``self(...)``, ``self.forward(...)``) routed through the compiled program while
    it runs: bound to the original, the method would call the original forward and silently run
    eagerly. A generator method is routed while each of its steps runs."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def steps(*args, **kwargs):
            if _eager_because_of_hooks(jitted, name):
                return method(*args, **kwargs)
            return _routed_steps(jitted, method(*args, **kwargs))
        return steps

    @functools.wraps(method)
    def run(*args, **kwargs):
        if _eager_because_of_hooks(jitted, name):
            return method(*args, **kwargs)
        with _forward_routed(jitted):
            return method(*args, **kwargs)
    return run


def _eager_because_of_hooks(jitted: JittedModule, name: str) -> bool:
    """Whether ``name`` must run eagerly (warned once per method) because the module has call
    hooks: the method calls the module, which runs its hooks, then the routed forward, whose
    program was captured from a call of the module and so runs them too: they would run twice."""
    if not _top_level_hooks(jitted._orig_mod):
        return False
    warned = jitted._keraunos.__dict__.setdefault("warned_hooks", set())
    if name not in warned:
        warned.add(name)
        _warn_at_user_line(
            f"keraunos: {jitted._keraunos.name}.{name} runs eagerly: the module has forward or "
            f"backward hooks of its own (or global ones), which the compiled program already "
            f"runs. Jit the model without them, or remove the hooks.", stacklevel=4)
    return True


def _routed_steps(jitted: JittedModule, generator):
    """Runs ``generator`` one step at a time with the forward routed, passing ``send`` and
    ``throw`` through; between steps the caller's code sees the original module unchanged."""
    sent, thrown = None, None
    while True:
        with _forward_routed(jitted):
            try:
                item = generator.throw(thrown) if thrown is not None else generator.send(sent)
            except StopIteration as stop:
                return stop.value
        sent, thrown = None, None
        try:
            sent = yield item
        except GeneratorExit:
            generator.close()
            raise
        except BaseException as e:  # noqa: BLE001 - thrown into us: the method decides
            thrown = e


_routing_lock = threading.Lock()


class _forward_routed:
    """While any thread is inside a method of the jitted module (``generate``, ``predict``...),
    the original module's ``forward`` (in its ``__dict__``) runs the compiled program; the first
    thread in installs it, the last one out restores what was there (counted, so threads cannot
    interleave a save and a restore)."""

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
                    return jitted(*a, **k)  # with the wrapper's own hooks, if it has any
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
        specialize_data: bool = False, fallback: str | Fallback = "dynamo",
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
        fallback: on such a decision (without ``specialize_data``), or a ``torch.func``
            transform inside the program: ``"dynamo"`` (default) warns once, naming the line and
            how to keep the program in one trace, and runs it through
            ``torch.compile(backend="keraunos")`` instead (graph breaks at such decisions);
            ``"error"`` raises the ``CaptureError`` (a ``DataDependentError``) naming the line.
    """
    if isinstance(fn_or_module, (JittedFunction, JittedModule)):
        raise TypeError("keraunos.jit: this callable is already jitted")
    if not callable(fn_or_module):
        raise TypeError(f"keraunos.jit: expected a function or an nn.Module, got "
                        f"{type(fn_or_module).__qualname__}")
    if isinstance(fn_or_module, type):
        # Calling a class builds an object during capture, from capture's fake tensors.
        what = "an nn.Module class" if issubclass(fn_or_module, torch.nn.Module) else "a class"
        raise TypeError(
            f"keraunos.jit: got {what}, {fn_or_module.__qualname__}, not an instance; its "
            f"objects would be built from capture's fake tensors. Build the object first and "
            f"jit that: keraunos.jit({fn_or_module.__name__}(...)).")
    options = JitOptions.validated(
        executors=executors, transforms=transforms, cache=cache,
        max_cache_entries=max_cache_entries, profile=profile, specialize_data=specialize_data,
        fallback=fallback, dynamic=dynamic)
    if _is_ddp(fn_or_module):
        return _jit_ddp(fn_or_module, options)
    if isinstance(fn_or_module, torch.nn.Module) and _fsdp_units(fn_or_module):
        return _jit_fsdp(fn_or_module, options)
    if isinstance(fn_or_module, torch.nn.Module):
        jitted = JittedModule(fn_or_module, options)
        for t in options.transforms:
            t.transform_module(jitted)
        return jitted
    return JittedFunction(fn_or_module, options)


def _is_ddp(module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(module, DistributedDataParallel)


def _jit_ddp(ddp: torch.nn.Module, options: JitOptions) -> "JittedModule":
    """``keraunos.jit(DistributedDataParallel(m))``: means what ``DistributedDataParallel(
    keraunos.jit(m))`` means. DDP's own forward (its reducer's bookkeeping, buffer syncs,
    ``no_sync()``) runs eagerly on every call, as it is; the module it wraps is jitted, and DDP
    calls the jitted one in its place for the duration of the call. Introspection
    (``last_traces``, ``cache_hits``) reads the wrapped module's entries."""
    inner = JittedModule(ddp.module, options)
    for t in options.transforms:
        t.transform_module(inner)
    jitted = JittedModule(ddp, options)

    def call_through_ddp(state, args, kwargs):
        wrapped = ddp._modules["module"]
        ddp._modules["module"] = inner
        try:
            return ddp(*args, **kwargs)
        finally:
            ddp._modules["module"] = wrapped
    object.__setattr__(jitted, "_keraunos", inner._keraunos)
    object.__setattr__(jitted, "_call", call_through_ddp)
    return jitted


def state_of(jitted) -> _JitState:
    try:
        return jitted._keraunos
    except AttributeError:
        raise TypeError(f"expected a callable returned by keraunos.jit, got {jitted!r}") from None



# ------------------------------------------------------------------------------- FSDP2
def _fsdp_units(module: torch.nn.Module) -> list:
    """The modules ``fully_shard`` was applied to, in ``module``'s tree (itself included)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # no module was sharded without it
    if fsdp is None:
        return []
    FSDPModule = fsdp.FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _refuse_sharded_units_inside(module: torch.nn.Module) -> None:
    """A jitted module whose submodules were ``fully_shard``ed after ``keraunos.jit``: its one
    program would have to run FSDP2's hooks (all-gathers, reshards) inside it."""
    units = [u for u in _fsdp_units(module) if u is not module]
    if units:
        from .errors import UnsupportedInputError
        name = next((n for n, m in module.named_modules() if m is units[0]), "?")
        raise UnsupportedInputError(
            f"keraunos.jit: {type(module).__qualname__}.{name} was fully_shard'ed after the "
            f"model was jitted; FSDP2's hooks (all-gather, reshard) must run eagerly between "
            f"compiled programs, not inside one. Jit the blocks before sharding them "
            f"(model.blocks[i] = keraunos.jit(block); fully_shard(model.blocks[i])), or jit the "
            f"sharded model (keraunos.jit(model) after every fully_shard): each unit's forward "
            f"is then compiled with FSDP2's hooks around it.")


class _UnitsState(_JitState):
    """What ``keraunos.jit`` of a ``fully_shard``ed model reports: its compiled units' caches
    together (hits and misses summed, the traces of the unit that compiled or ran last)."""

    def __init__(self, module, options: JitOptions, units: list):
        super().__init__(module.forward, module, options)
        self.units = units  # the compiled units' states, in module order

    hits = property(lambda self: sum(u.hits for u in self.units), lambda self, v: None)
    misses = property(lambda self: sum(u.misses for u in self.units), lambda self, v: None)

    @property
    def last_entry(self):
        ran = [u for u in self.units if u.last_entry is not None]
        return max(ran, key=lambda u: u.last_used).last_entry if ran else None

    @last_entry.setter
    def last_entry(self, value):
        pass


def _jit_fsdp(model: torch.nn.Module, options: JitOptions) -> JittedModule:
    """``keraunos.jit`` of a model with ``fully_shard`` units (FSDP2). FSDP2's hooks are
    ``torch._dynamo.disable``d: they all-gather, reshard, cast for mixed precision and
    reduce-scatter gradients, and must run eagerly, as they do under ``torch.compile``. Capture
    has no graph breaks, so what is compiled is each *innermost* unit's own ``forward`` (a unit
    with no unit inside it, e.g. each transformer block), captured from the forward itself, not
    from a call of the module: ``nn.Module.__call__`` runs FSDP2's hooks eagerly around it, and
    the compiled program sees the unsharded parameters (plain tensors) that the pre-forward hook
    registered. The rest (the root unit's own code between its units: embeddings, final norm,
    head) runs eagerly. The units are compiled in place: each one's ``forward`` is its compiled
    program from now on, whoever calls it (FSDP's activation-checkpoint recomputation in the
    backward, the model called directly), as ``nn.Module.compile()`` does."""
    units = _fsdp_units(model)
    jitted_units = [u for u in units if isinstance(u, JittedModule)]
    if jitted_units:
        raise TypeError(
            "keraunos.jit: this fully_shard'ed model has units that are jitted already "
            f"({type(jitted_units[0]).__qualname__}); jit either the blocks before fully_shard "
            "(fully_shard(keraunos.jit(block))) or the sharded model, not both.")
    innermost = [u for u in units
                 if not any(v is not u and v in units for v in u.modules())]
    states = []
    for unit in innermost:
        if "forward" in unit.__dict__ and getattr(unit.__dict__["forward"], "_keraunos_unit",
                                                  None) is not None:
            states.append(unit.__dict__["forward"]._keraunos_unit)  # jitted before: same cache
            continue
        state = _JitState(unit.forward, unit, options)
        state.forward_only = True
        run = call_profiled if options.profile else call

        def compiled_forward(*args, _state=state, _run=run, **kwargs):
            _state.last_used = time.perf_counter()
            return _run(_state, args, kwargs)
        compiled_forward = functools.wraps(unit.forward)(compiled_forward)
        compiled_forward._keraunos_unit = state
        unit.__dict__["forward"] = compiled_forward
        states.append(state)
    for state in states:
        state.__dict__.setdefault("last_used", 0.0)
    jitted = JittedModule(model, options)
    object.__setattr__(jitted, "_keraunos", _UnitsState(model, options, states))
    object.__setattr__(jitted, "_call", lambda state, args, kwargs: model(*args, **kwargs))
    return jitted
