"""The call path of a jitted callable, its cache entries, and compilation on a miss.

(What ``keraunos.jit`` returns, the wrappers that call this path, is in ``runtime/jitted.py``.)

A call is the design's three steps:

    entry, inputs, pro_to_epi = get_computation_and_inputs(jitted, args, kwargs)
    result = entry.computation_fn(*inputs)
    return maybe_call_epilogue(entry, result, pro_to_epi)

An entry is valid for a call when its prologue's checks pass and ``check_storage_aliases``
finds the inputs share memory exactly as they did when it was compiled; the entries are tried
most recently used first, and a miss compiles a new one.

Each entry runs the three steps in a row through its *hit path* (``runtime/hit_path.py``, made
from the fast prologue's record): ``hit(args, kwargs)``. Its outcome is one of three:

- ``(result,)``: its checks passed and the program ran;
- a ``ProgramRaised``: its checks passed and the program raised; ``call`` raises the error and
  never tries the call again;
- anything else: it does not take the call (what the failed check returned: the index of its
  description, or a reason; ``explain`` puts it in words).

``call`` tries the front entry's hit path, ``call_past_hit_path`` the others' and then the
miss. Print one with ``print(keraunos.state_of(jitted).last_entry.hit_trace)``. The native hit
path (``keraunos/runtime/native``), made from the same record, does the front entry's in one C
call where it can check it whole (``_sync_native`` keeps it on the front entry); the three
steps apart (``get_computation_and_inputs``) are what ``profile=True`` and
``keraunos.report``'s timing run, so that each step is seen by name.

There is no separate step that connects the result to autograd (the design's
``maybe_connect_to_autograd``): for an entry with a backward trace, ``computation_fn`` runs the
forward inside a ``torch.autograd.Function`` (``autograd/function.py``), because autograd records
a node only while the forward runs. Wrapping results after the fact would hand back new tensor
objects where the program returns its inputs, and eager returns the very objects.
"""
from __future__ import annotations

import enum
import itertools
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from .. import debug
from .. import executors as executors_module
from . import native
from .cache import NOT_ASKED, CacheEntry, CacheMode, tensor_positions
from ..capture.leaks import capture_values_in, capture_values_in_user_state
from ..capture.state import active_context
from ..capture.symbolic import DynamicRequest
from ..errors import (FALLBACK_ERRORS, CaptureError, DataDependentError, LazyStateError,
                      UnsupportedInputError, user_source)
from .hit_path import (ProgramRaised, alias_check_for, alias_pattern_of, check_storage_aliases,
                       hit_path, reraise)
from .compilation import CompileRequest
from .pipeline import compile_entry
from .rebind import rebind_entry
from .tiers import FuseMode, default_mode
from ..torch_internals import autograd as autograd_internals
from ..torch_internals.functorch import is_functorch_wrapped_tensor
from ..transforms import Transform


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
    # Which tier ran the last call: "torch" (eager's kernels) or "fused" (Inductor's regions);
    # for an entry fused in the background, the number of calls before it switched (calls after
    # it run fused), how long the fused compile took, its stages, and whether it is still going.
    tier: str = "torch"
    fused_from_call: int | None = None
    fusion_seconds: float | None = None
    fusion_stages: dict[str, float] | None = None
    fusion_pending: bool = False
    fusion_note: str | None = None
    # What the program store did with the entry: "loaded" (no capture ran), "kept", or
    # "not kept: <why>" (persist/programs.py).
    program_store: str | None = None
    # Which hit path serves the entry's calls: "native" (one C call checks and runs it), or
    # "python (<why not native>)"; and, for a fused entry, how its C++ kernels were built:
    # "one file per module", or "one by one (<why>)" (executors/fusion/one_build.py).
    hit_path: str | None = None
    kernel_build: str | None = None

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
    fuse: FuseMode = FuseMode.BACKGROUND
    # Besides programs with ``tiers.MIN_FUSED_OPS`` ops a region would compute in a trace,
    # those with at least this many in the forward are fused in the background too (None: no
    # others). The torch.compile backend sets it (``dynamo/backend.py`` says why).
    min_fused_forward_ops: int | None = None
    # Regions are cut at layer boundaries, so that identical layers share one compiled kernel,
    # when a trace calls at least this many layers of one kind (``executors/fusion/layers.py``);
    # fewer, and its regions are cut only where fusion must. The torch.compile backend raises it
    # (``dynamo/backend.py`` says why).
    min_shared_layers: int = 2

    @classmethod
    def validated(cls, *, executors=None, transforms=None, cache="constant values",
                  max_cache_entries=8, profile=None, specialize_data=False, fallback="dynamo",
                  dynamic=None, fuse=None) -> "JitOptions":
        for t in transforms or ():
            if not isinstance(t, Transform):
                raise TypeError(f"keraunos.jit: transforms must be keraunos.Transform instances, "
                                f"got {t!r}")
        if dynamic not in (None, True, False):
            raise ValueError(f"keraunos.jit: dynamic must be None, True or False, got {dynamic!r}")
        if max_cache_entries < 1:
            raise ValueError("keraunos.jit: max_cache_entries must be at least 1")
        fuse = _member(FuseMode, default_mode() if fuse is None else fuse, "fuse")
        if executors is None:
            executors = executors_module.DEFAULT_EXECUTORS if fuse is not FuseMode.OFF else (
                "torch",)
        return cls(tuple(executors_module.resolve(executors)), tuple(transforms or ()),
                   _member(CacheMode, cache, "cache"), max_cache_entries,
                   _profile_default() if profile is None else bool(profile),
                   bool(specialize_data), _member(Fallback, fallback, "fallback"), dynamic, fuse)


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
        # Hits are counted by ``next``, one C call: threads lose no count, and no lock is held.
        self.hit_count = itertools.count()
        self.misses = 0  # counted under ``lock``
        # The entry that served the last call the general path served, what its lookup took,
        # and hits + misses then (the hit path records nothing: see ``last_entry``).
        self._last_entry: CacheEntry | None = None
        self._last_lookup = 0.0
        self._served_at = 0
        self.compiled_at_call = 0  # hits + misses when the last miss happened
        self.last_miss_reasons: list[str] = []
        self.warned_recompiles = False
        self.warned_no_backward = False
        # Automatic dynamic: the sizes and ints of earlier compilations, by path (see
        # capture/symbolic.py); a value that changed is compiled as a symbol from then on.
        self.seen_sizes: dict = {}
        self.symbolic_fallbacks: list[str] = []  # why symbolic entries were compiled exactly
        self.warned_transform = False  # called under a torch.func transform: warned once
        self.lazy_state_calls = 0  # calls run eagerly because they made state (LazyStateError)
        # A unit of a fully_shard'ed model: captured from its ``forward`` alone (its call hooks
        # are FSDP2's, run eagerly around the program; runtime/jitted.py, _jit_fsdp), and when it last ran.
        self.forward_only = False
        self.last_used = 0.0
        # FSDP2 units: the states of the other units (a ``WeakSet``), whose entries are
        # rebound to this one (``pipeline.rebind_entry``) rather than compiled again.
        self.siblings = ()
        # The program fell back to torch.compile(backend="keraunos"): what it compiled.
        self.dynamo_compiled = None
        # Methods routed through the compiled forward (runtime/jitted.py): how deep such calls are
        # nested, and the original's own ``forward`` attribute to put back after the outermost.
        self.routing_depth = 0
        self.saved_forward = None
        # A JittedFunction served by the native hit path (runtime/jitted.py, _go_native): its
        # ``__call__``, whose ``hit`` is the front entry's (``_sync_native`` keeps it so).
        self.native_front = None

    @property
    def hits(self) -> int:
        return int(repr(self.hit_count)[len("count("):-1])  # an itertools.count shows its next value

    # The hit path serves the front entry and records nothing but the hit, so a call since the
    # last one the general path served was a hit of the front entry.
    @property
    def last_entry(self) -> CacheEntry | None:
        """The entry that served the last call."""
        if self._served_at == self.hits + self.misses or not self.entries:
            return self._last_entry
        return self.entries[0]

    @last_entry.setter
    def last_entry(self, entry: CacheEntry | None) -> None:
        self._last_entry = entry
        self._served_at = self.hits + self.misses

    @property
    def last_lookup(self) -> float:
        """What the last call's cache lookup took; after a hit of the hit path (untimed), what
        the entry's checks took on the call that compiled it."""
        if self._served_at == self.hits + self.misses or not self.entries:
            return self._last_lookup
        return self.entries[0].check_seconds

    @last_lookup.setter
    def last_lookup(self, seconds: float) -> None:
        self._last_lookup = seconds
        self._served_at = self.hits + self.misses

    @property
    def name(self) -> str:
        target = self.module if self.module is not None else self.fn
        return getattr(target, "__qualname__", None) or type(target).__qualname__


# --------------------------------------------------------------------------------- call path
def get_computation_and_inputs(state: _JitState, args: tuple, kwargs: dict,
                               start: float | None = None):
    """The entry that fits this call, with its inputs and what the epilogue takes; compiles on
    a miss. The three steps apart (``profile=True``'s ranges, ``keraunos.report``'s timing):
    each entry's prologue, then its alias check, as its hit path runs them."""
    if start is None:
        start = _clock()
    entries = state.entries
    for i in range(len(entries)):
        entry = entries[i]
        try:
            r = entry.prologue_fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            # A prologue that cannot even unpack this call (an object of the right class that
            # lacks an attribute the entry reads) means "not this entry", as a failed check
            # does: the next entries still get their turn. When none fits, the miss path
            # captures the program again, which raises the user's own error if there is one.
            continue
        if type(r) is tuple and entry.alias_check(r[0]):
            if i:
                _promote(state, entry)
            next(state.hit_count)
            state.last_entry = entry
            state.last_lookup = _clock() - start
            return entry, r[0], r[1]
    return _miss(state, args, kwargs, start)


_clock = time.perf_counter


def maybe_call_epilogue(entry: CacheEntry, result, pro_to_epi):
    return entry.epilogue_fn(result, pro_to_epi)


def call(state: _JitState, args: tuple, kwargs: dict):
    """One call: the hit path of the most recently used entry (what decides a small function's
    overhead), then ``get_computation_and_inputs`` for the others and the miss. A hit of the
    hit path records nothing but the count: no clock read, no ``last_entry`` (``_JitState``
    derives both)."""
    # JittedFunction.__call__ and a JittedModule's forward make these first lines themselves
    # (a frame less a call); the rest is ``call_past_hit_path``.
    entries = state.entries
    if entries:
        try:
            r = entries[0].hit_fn(args, kwargs)
        except Exception:  # noqa: BLE001
            r = None  # the checks could not run on this call: "not this entry"
        if type(r) is tuple:
            next(state.hit_count)
            return r[0]
        if type(r) is ProgramRaised:
            reraise(r)
    return call_past_hit_path(state, args, kwargs)


def call_past_hit_path(state: _JitState, args: tuple, kwargs: dict):
    """The call after the most recent entry's hit path said "not this entry" (or with no
    entry yet): the other entries' hit paths, most recently used first, then the miss. The one
    that serves the call moves to the front."""
    start = _clock()  # timed from here: the hit path's own checks are not timed
    entries = state.entries
    for i in range(1, len(entries)):
        entry = entries[i]
        trying = _clock()
        try:
            r = entry.hit_fn(args, kwargs)
        except Exception:  # noqa: BLE001 - the checks could not run on this call: next entry
            continue
        if type(r) is tuple or type(r) is ProgramRaised:  # its checks passed
            _promote(state, entry)
            next(state.hit_count)
            state.last_entry = entry
            # What finding it cost: the entries tried before, and its own checks as they ran
            # on the call that compiled it (the hit ran them together with the program).
            state.last_lookup = trying - start + entry.check_seconds
            if type(r) is tuple:
                return r[0]
            reraise(r)
    entry, inputs, pro_to_epi = _miss(state, args, kwargs, start)
    return entry.epilogue_fn(entry.computation_fn(*inputs), pro_to_epi)


def _call_checking_results(state: _JitState, args: tuple, kwargs: dict):
    """``call``, then a search of the result for capture's FakeTensors, which must never reach
    the user (on with ``KERAUNOS_CHECK_RESULTS=1``; the test suite runs with it)."""
    return checked_result(state, _call_unchecked(state, args, kwargs))


def checked_result(state: _JitState, result):
    """``result``, once searched for capture's FakeTensors (``_call_checking_results``)."""
    if active_context() is not None:  # called while capturing another program: inlined, fake
        return result
    found = capture_values_in(result)
    if found is not None:
        raise AssertionError(f"keraunos internal error: {found} is a FakeTensor made during "
                             f"capture, handed back by a call of {state.fn!r}")
    return result


def _check_user_state(state: _JitState, args: tuple, kwargs: dict) -> None:
    """After a capture, under ``KERAUNOS_CHECK_RESULTS=1`` (the test suite: an error) or
    ``KERAUNOS_DEBUG`` (a warning): no FakeTensor of capture's is left in what the user keeps."""
    if not (CHECK_RESULTS or debug.level()):
        return
    found = capture_values_in_user_state(state.module, args, kwargs)
    if found is None:
        return
    message = (f"keraunos internal error: capture of {state.name} left an object of its own in "
               f"{found}; please report this with the program")
    if CHECK_RESULTS:
        raise AssertionError(message)
    warnings.warn(message, stacklevel=2)


_call_unchecked = call
if os.environ.get("KERAUNOS_CHECK_RESULTS", "0") not in ("", "0"):
    call = _call_checking_results
CHECK_RESULTS = call is not _call_unchecked  # JittedFunction checks its results itself


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
        _sync_native(state)


def _sync_native(state: _JitState) -> None:
    """After ``state.entries`` changed: the native hit path serves the new front entry (when it
    can). The loader's thread may call this too (``jitted._go_native``): whoever writes last
    wrote it for the entries that are there, since each writer checks them again after."""
    front = state.native_front
    if front is None:
        return
    while True:
        entries = state.entries
        front.hit = _native_hit(entries[0]) if entries else None
        if state.entries is entries:
            return


def _native_hit(entry: CacheEntry):
    """``entry``'s native ``Hit``, made once (None where the native hit path cannot serve it):
    it checks what the prologue checks; ``native.hit_for`` decides which entries it takes."""
    if entry.native_hit is NOT_ASKED:
        try:
            hit = native.hit_for(entry)
        except Exception as e:  # noqa: BLE001 - an unexpected guard object: Python
            hit = f"{type(e).__name__}: {e}"
        if isinstance(hit, str):
            debug.logger.debug("keraunos: no native hit path for an entry: %s", hit)
            entry.native_note, hit = hit, None
        entry.native_hit = hit
    return entry.native_hit


# ----------------------------------------------------------------------------------- misses
def explain(entry: CacheEntry, args: tuple, kwargs: dict) -> str | None:
    """Why ``entry`` does not fit this call, in words; ``None`` when it does."""
    return _verdict(entry, args, kwargs)[0]


def _verdict(entry: CacheEntry, args: tuple, kwargs: dict) -> tuple[str | None, tuple | None]:
    """``(why entry does not fit this call, None)``, or ``(None, what its prologue returned)``."""
    try:
        r = entry.prologue_fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure to unpack is a reason
        return f"the prologue could not unpack the call: {type(e).__name__}: {e}", None
    if type(r) is int:
        description = entry.check_descriptions[r]
        live = getattr(description, "explain_miss", None)  # ambient.AmbientDifference
        return f"check failed: {live() if live is not None else description}", None
    if type(r) is str:
        return f"check failed: {r}", None
    for i, view in entry.written_views:
        if r[0][i]._is_view() is not view:
            was, now = ("a view of another tensor", "a tensor of its own")[::1 if view else -1]
            return (f"input {i}, which the program writes, was {was} when compiled and is "
                    f"{now} now (autograd's in-place rules tell them apart)"), None
    if not check_storage_aliases(entry, r[0]):
        return (f"inputs share memory differently: compiled for alias pattern "
                f"{entry.alias_pattern}, called with {alias_pattern_of(entry, r[0])}"), None
    return None, r


# Calls a jitted callable runs eagerly because they made state (``LazyStateError``): its first
# call, and a few more (an optimizer's parameter that gets its first gradient later).
LAZY_STATE_CALLS = 4


def _miss(state: _JitState, args: tuple, kwargs: dict, start: float):
    if active_context() is not None:  # called while capturing another program: inline it
        return _inline_entry(state), (args, kwargs), None
    if _under_function_transform(args, kwargs):
        return _eager_under_transform(state), (args, kwargs), None
    with state.lock:
        reasons = []
        for entry in state.entries:  # another thread may have compiled it meanwhile
            reason, r = _verdict(entry, args, kwargs)
            if reason is None:
                next(state.hit_count)
                state.last_entry = entry
                state.last_lookup = _clock() - start
                return entry, r[0], r[1]
            reasons.append(reason)
        state.last_miss_reasons = reasons
        lookup = _clock() - start  # what the failed checks cost, before compiling
        state.misses += 1  # under state.lock, as every miss
        state.compiled_at_call = state.hits + state.misses  # compile_stats: this call missed
        try:
            entry = _compile(state, args, kwargs)
        except CaptureError as e:
            _check_user_state(state, args, kwargs)
            if isinstance(e, LazyStateError) and state.lazy_state_calls < LAZY_STATE_CALLS:
                # State made on this call (an optimizer's first step): made for real by running
                # the program eagerly; the next call captures a program that reads it.
                state.lazy_state_calls += 1
                state.last_miss_reasons = reasons + [str(e).splitlines()[0]]
                return _inline_entry(state), (args, kwargs), None
            if state.options.fallback is not Fallback.DYNAMO or not isinstance(
                    e, FALLBACK_ERRORS):
                raise
            entry = _dynamo_fallback_entry(state, e)
            state.entries = [entry]  # dynamo's guards decide from now on: it always hits
            _sync_native(state)
            state.last_entry = entry
            return entry, (args, kwargs), None
        _check_user_state(state, args, kwargs)
        debug.compiled(state, entry)  # KERAUNOS_DEBUG logging and trace files; history for reports
        r = entry.prologue_fn(*args, **kwargs)
        checking = _clock()  # once more, warm: what a hit's checks take (compile_stats)
        entry.prologue_fn(*args, **kwargs)
        entry.check_seconds = _clock() - checking
        if type(r) is not tuple:
            raise AssertionError(f"keraunos: internal error: a freshly compiled prologue rejects "
                                 f"the call it was compiled for ({explain(entry, args, kwargs)})")
        # The sharing of this call's inputs: an entry captured here was captured for it, and a
        # loaded or rebound one was checked to have been compiled for the same
        # (``cache.sharing_of``).
        entry.alias_positions = tensor_positions(entry, r[0])
        if entry.alias_positions is not None:
            entry.alias_pattern = alias_pattern_of(entry, r[0])
        if entry.written_positions and torch.is_grad_enabled():
            entry.written_views = tuple((i, r[0][i]._is_view()) for i in entry.written_positions
                                        if isinstance(r[0][i], torch.Tensor))
        entry.alias_check = alias_check_for(entry)
        entry.hit_fn, entry.hit_trace = hit_path(entry)
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
    if state.module is not None and not state.forward_only:
        _refuse_sharded_units_inside(state.module)
    shared = _entry_of_an_identical_unit(state, args, kwargs)
    if shared is not None:
        return shared
    stashed = []
    while (top := autograd_internals.top_saved_tensors_hooks(True)) is not None:
        stashed.append(top)
        autograd_internals.pop_saved_tensors_hooks()
    try:
        return _compile_exact_or_symbolic(state, args, kwargs)
    finally:
        for pack, unpack in reversed(stashed):
            autograd_internals.push_saved_tensors_hooks(pack, unpack)


def _entry_of_an_identical_unit(state: _JitState, args: tuple,
                                kwargs: dict) -> CacheEntry | None:
    """An entry another unit of the model compiled, rebound to this unit, when this unit is of
    the same class with the same ``forward`` and the rebound prologue accepts the call (it
    checks everything the program assumed: submodule types, attributes, parameter metadata,
    hooks): identical blocks then share one compiled program, as ``torch.compile`` shares one
    graph between them."""
    module, forward = state.module, getattr(state.fn, "__func__", None)
    for other in list(state.siblings):
        if (other is state or type(other.module) is not type(module) or forward is None
                or getattr(other.fn, "__func__", None) is not forward
                or other.options != state.options or other.forward_only != state.forward_only):
            continue
        for entry in other.entries:
            try:
                # Captured from its forward alone, a unit's own hooks are FSDP2's, around the
                # program; captured from a call of the module, they are in it.
                rebound = rebind_entry(entry, other.module, module, args, kwargs,
                                       own_hooks_in_program=not state.forward_only)
            except Exception:  # noqa: BLE001 - a prologue that cannot unpack this call
                rebound = None
            if rebound is not None:
                return rebound
    return None


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
    try:
        entry = compile_entry(state, args, kwargs, CompileRequest(dynamic=request))
    except Exception as e:  # noqa: BLE001 - exact sizes are the safe way for anything
        if not request.any_dynamic:
            raise
        # The last few only: a program that always falls back must not grow this list.
        state.symbolic_fallbacks = state.symbolic_fallbacks[-15:] + [f"{type(e).__name__}: {e}"]
        entry = None
    state.seen_sizes = {**state.seen_sizes, **request.updated}
    if entry is None:
        return compile_entry(state, args, kwargs)
    if request.changes:
        state.last_miss_reasons = state.last_miss_reasons + [
            f"{change}; recompiled with it symbolic" for change in request.changes]
    return entry


_is_functorch_tensor = is_functorch_wrapped_tensor


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
    return CacheEntry(prologue_fn=lambda *a, **k: None,
                      computation_fn=lambda args, kwargs: target(*args, **kwargs),
                      epilogue_fn=lambda result, _: result)


def _no_dynamo_backend() -> Callable:
    raise RuntimeError("keraunos: the torch.compile fallback is wired by `import keraunos`")


# Returns ``keraunos.dynamo.backend``, the torch.compile route that programs capture refuses fall
# back to. The package (``keraunos/__init__.py``, above both layers) sets it: the route compiles
# its graphs with ``keraunos.jit``, so this layer cannot import it.
_dynamo_backend: Callable[[], Callable] = _no_dynamo_backend


def set_dynamo_backend(load: Callable[[], Callable]) -> None:
    """Wire the fallback route: ``load()`` imports and returns ``keraunos.dynamo.backend``."""
    global _dynamo_backend
    _dynamo_backend = load


def _dynamo_fallback_entry(state: _JitState, error: CaptureError) -> CacheEntry:
    """An entry that runs the program through torch.compile with the keraunos backend, with
    this callable's executors and transforms; warns once, naming the line that forced it."""
    backend = _dynamo_backend()  # imports dynamo: only paid by programs that fall back
    target = state.module if state.module is not None else state.fn
    compiled = _keeping_distribution_validation(torch.compile)(
        target, backend=backend(executors=state.options.executors,
                                transforms=state.options.transforms, fuse=state.options.fuse))
    state.dynamo_compiled = compiled  # keraunos.dynamo.last_traces(jitted) finds it here
    compiled = _keeping_distribution_validation(compiled)
    lines = str(error).splitlines()
    where = lines[0].removeprefix("keraunos cannot capture ")
    advice = next((line.strip().rstrip(".") for line in lines[2:]
                   if line.strip().startswith("What to do")),
                  None) if not isinstance(error, DataDependentError) else None
    if advice is None:
        advice = ("To keep the whole program in one trace: keep such decisions in tensors "
                  "(torch.where, masks), pass the value in as a Python argument, or let "
                  "keraunos.jit(..., specialize_data=True) compute it in the prologue")
    message = (f"keraunos.jit: {state.name} falls back to torch.compile(backend=\"keraunos\") "
               f"because of {where}\n  {lines[1].strip()}\n  The cost: dynamo's bytecode analysis "
               f"and guards on every call, and the program runs as several compiled subgraphs "
               f"split at graph breaks, with Python in between.\n  {advice}; "
               f"keraunos.jit(..., fallback=\"error\") raises instead of falling back.")
    _warn_at_user_line(message, stacklevel=5)
    entry = CacheEntry(prologue_fn=lambda *a, **k: ((a, k), None),
                       computation_fn=lambda args, kwargs: compiled(*args, **kwargs),
                       epilogue_fn=lambda result, _: result)

    def hit(args, kwargs):  # dynamo's guards check every call: it takes them all
        try:
            return (compiled(*args, **kwargs),)
        except Exception as error:  # noqa: BLE001 - the program's own (hit_path's outcomes)
            return ProgramRaised(error)
    entry.hit_fn = hit
    return entry


def _keeping_distribution_validation(compiled):
    """``compiled`` (``torch.compile`` or what it made), leaving ``torch.distributions``'
    argument validation as the call found it: Dynamo's first use in a process turns it off for
    good (its ``TorchPatcher``), which a program that merely fell back must not do to the user's
    distributions."""
    distribution = torch.distributions.Distribution

    def run(*args, **kwargs):
        validate = distribution._validate_args
        try:
            return compiled(*args, **kwargs)
        finally:
            if distribution._validate_args is not validate:
                distribution.set_default_validate_args(validate)
    return run


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
            if any("param_groups[" in r for r in state.last_miss_reasons):
                message += (" An optimizer's hyperparameter changes (an LR scheduler's "
                            "learning rate or momentum): give the optimizer a tensor learning "
                            "rate (AdamW(params, lr=torch.tensor(1e-3))), which its scheduler "
                            "updates in place and the program reads on every call.")
            _warn_at_user_line(message, stacklevel=3)
    state.entries = entries
    _sync_native(state)


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
        name = next((n for n, m in module.named_modules() if m is units[0]), "?")
        raise UnsupportedInputError(
            f"keraunos.jit: {type(module).__qualname__}.{name} was fully_shard'ed after the "
            f"model was jitted; FSDP2's hooks (all-gather, reshard) must run eagerly between "
            f"compiled programs, not inside one. Jit the blocks before sharding them "
            f"(model.blocks[i] = keraunos.jit(block); fully_shard(model.blocks[i])), or jit the "
            f"sharded model (keraunos.jit(model) after every fully_shard): each unit's forward "
            f"is then compiled with FSDP2's hooks around it.")
