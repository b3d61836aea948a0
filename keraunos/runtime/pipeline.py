"""Compilation on a cache miss: capture, transforms, passes, the autograd split, executors,
code generation. Every stage's trace is kept (``last_traces`` and friends) with its time."""
from __future__ import annotations

import copy
import functools
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from .. import executors as executors_module
from . import tiers
from ..autograd import make_autograd_computation, split_forward_backward
from ..autograd.buckets import active_ddp_bucket_caps, display_trace, plan_segments
from ..autograd.function import make_segmented_computation
from .cache import CacheEntry, CacheMode, sharing_of, storage_alias_pattern
from .. import debug
from . import native
from ..persist import programs as program_store
from ..capture.program import Program, capture_program
from ..capture.state import _active
from ..capture.symbolic import DynamicRequest
from ..core.proxies import Proxy, TensorProxy
from ..core import lint
from ..core.runner import trace_pass, trace_step
from ..core.symbolic import refuse_raw_symbols
from ..core.tags import COPY_OF_WRITTEN_INPUT, OPAQUE
from ..core.trace import Trace
from .fast_prologue import fast_prologue
from ..passes.peephole import peephole_stage
from ..passes import common_subexpression_elimination, dead_code_elimination, delete_last_used
from ..passes.functionalize import functionalize_writes
from ..passes.reinplace import can_reinplace, every_op_without_grad, reinplace
from .structure import hook_state
from .tiers import FuseMode, Tiering

# The computation's optimization passes, in order (each ``trace -> trace``, see core/runner.py).
OPTIMIZATIONS = (dead_code_elimination, common_subexpression_elimination, dead_code_elimination)


@trace_pass("Common Subexpression Elimination (backward)")
def _backward_cse(trace: Trace) -> list:
    """CSE of the backward, where two lines may give the same gradient (``distinct_outputs``)."""
    return common_subexpression_elimination.__wrapped__(trace, distinct_outputs=False)


# The backward's optimization passes, in order, after the autograd split.
BACKWARD_OPTIMIZATIONS = (_backward_cse, dead_code_elimination)


@dataclass
class Compilation:
    """One compilation in progress: every trace each stage made, in order, and each stage's time
    (what ``last_traces`` and ``compile_stats`` show). A stage reads the latest traces and
    records the ones it makes."""

    state: Any
    program: Any                               # capture's Program: the first three traces
    prologues: list[Trace]
    computations: list[Trace]
    epilogues: list[Trace]
    backwards: list[Trace] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    split: Any = None                          # the autograd split, when there is a backward
    records_autograd: bool = False             # no backward trace: torch's autograd records ops
    fusion_regions: list = field(default_factory=list)
    executors: tuple = ()                      # who claims lines (tier 0: no fusion executors)
    fusion_note: str | None = None             # why the program is not fused (compile_stats)
    # Inside DistributedDataParallel's forward: its bucket sizes, read when capture ran (the
    # fused tier's worker runs after the forward). The backward is then split at its bucket
    # boundaries (``split_at_ddp_buckets``) into ``segments``.
    bucket_caps: Any = None
    segments: Any = None
    # Loaded from the program store (``persist/programs.py``) instead of captured; what the store
    # did with this compilation (compile_stats's ``program_store``); for a loaded one, the
    # captured facts make_entry needs: (number of inputs, the inputs it writes).
    loaded: bool = False
    program_store: str | None = None
    facts: tuple | None = None
    # For a loaded one: how the inputs of the call that captured it shared memory
    # (``cache.sharing_of``), which a call it serves must repeat.
    sharing: tuple | None = None
    # Where the fusion executors compile regions (``compiler.CompileSite``; None: here, now).
    site: Any = None

    @property
    def computation(self) -> Trace:
        return self.computations[-1]

    @property
    def backward(self) -> Trace | None:
        return self.backwards[-1] if self.backwards else None

    def time(self, label: str, seconds: float) -> None:
        self.stages[label] = self.stages.get(label, 0.0) + seconds  # DCE runs twice: summed


def compile_entry(state, args, kwargs) -> CacheEntry:
    """Capture the program, run every stage in ``STAGES`` order, then the fast prologue, the
    claims and what follows them (``TIER_STAGES``) once per tier: the entry holds it all. With
    fusion in the background, the entry runs tier 0 (no fusion executors) and switches to the
    fused tier when the worker has compiled it (``runtime/tiers.py``). A program kept by the program
    store (``persist/programs.py``) whose readable prologue accepts the call stands in for capture
    and ``STAGES``; a captured one is kept there."""
    native.LOADER.poll()  # a native hit path built in the background is imported here
    key, why_not, key_seconds = program_key(state, args, kwargs)
    c, refused = load_program(state, key, args, kwargs) if key is not None else (None, None)
    # (``refused``: why a stored program under the key did not serve the call)
    if refused is not None:
        debug.logger.debug("keraunos: %s: the stored program did not serve the call (%s); "
                           "capturing it again", state.name, refused)
    if c is not None:
        c.time("program key", key_seconds)
        try:
            return _finish(state, c, args, kwargs)
        except Exception as e:  # noqa: BLE001 - captured (and kept again) as if nothing were stored
            refused = ("its prologue rejected the call" if isinstance(e, _StoredProgramRejected)
                       else f"{type(e).__name__}: {e}")
            debug.logger.debug("keraunos: %s: the stored program loaded but did not serve the "
                               "call (%s); capturing it again", state.name, refused)
    c = capture(state, args, kwargs)
    for stage in STAGES:
        stage(c)
    kept = why_not
    if key is not None:
        c.time("program key", key_seconds)
        kept = program_to_keep(c)
    c.program_store = kept if type(kept) is str else "keeping (pickled in the background)"
    if refused is not None:
        c.program_store += f"; the stored program was refused ({refused})"
    entry = _finish(state, c, args, kwargs)
    if type(kept) is dict:
        kept = _with_sharing(kept, entry, args, kwargs)
        if type(kept) is str:
            entry.program_store = kept
    if type(kept) is dict:
        # Pickling the 32-layer model's program takes 0.2-0.5 s: not before the first result.
        # The traces are done (passes derive new ones); the module tree's paths are taken now.
        entry_ref = weakref.ref(entry)

        def kept_note(note: str) -> None:
            kept_entry = entry_ref()
            if kept_entry is not None:
                kept_entry.program_store = note + (
                    f"; the stored program was refused ({refused})" if refused else "")
        program_store.keep_in_background(key, kept, state.module if state.module is not None
                                         else state.fn, kept_note, owner=state)
    return entry


class _StoredProgramRejected(Exception):
    """A loaded program's fast prologue rejected the call its readable prologue accepted, or
    the call's inputs share memory otherwise than the capturing call's did."""


def _finish(state, c: Compilation, args, kwargs) -> CacheEntry:
    """The fast prologue, the tiers, code generation: the entry."""
    fast_prologue_stage(c)
    mode = _fuse_mode(c)
    if mode is FuseMode.BACKGROUND:
        fused = _fork(c)
        c.executors = _without_fusion(c.executors)
    elif mode is FuseMode.OFF:
        c.executors = _without_fusion(c.executors)
    for stage in TIER_STAGES:
        stage(c)
    entry = make_entry(c, Tiering(mode) if mode is FuseMode.BACKGROUND else None)
    if c.loaded:
        # The readable prologue accepted the call; the fast one must too, and the inputs must
        # share memory as those of the capturing call did: the key cannot see it (two views of
        # one tensor have the key of two tensors of their own), and a program captured for
        # inputs of their own may compute other values for shared ones, or not raise where
        # eager raises on an overlapping write (fuzz case 16100:160).
        r = entry.prologue_fn(*args, **kwargs)
        if type(r) is not tuple or sharing_of(entry, r[0]) != c.sharing:
            raise _StoredProgramRejected()
    if mode is FuseMode.BACKGROUND:
        # What the helpers' compiles depend on is read now, on the user's thread.
        fused.site = next(e for e in executors_module.fusion_executors(fused.executors)
                          if e.compiles_elsewhere).compile_site(True)
        tiers.schedule(entry.tiering, lambda: _fused_tier(fused),
                       _switcher(weakref.ref(state), weakref.ref(entry)), entry, state)
    return entry


def _with_sharing(kept: dict, entry: CacheEntry, args, kwargs) -> dict | str:
    """``kept`` with how this call's inputs share memory (``cache.sharing_of``): a load serves
    only calls whose inputs share it alike (``_finish``)."""
    r = entry.prologue_fn(*args, **kwargs)
    if type(r) is not tuple:  # the miss path reports it (a prologue that rejects its own call)
        return "not kept: its prologue rejects the call it was captured on"
    return {**kept, "sharing": sharing_of(entry, r[0])}


def program_key(state, args, kwargs) -> tuple[str | None, str | None, float]:
    """The program store's key for this compilation, or None and why it is not kept; what
    making the key took. With sizes that may be symbolic (``_active.dynamic``), the key holds
    which are, decided as capture decides them (``_predicted_sizes``)."""
    _active.predicted_sizes = None
    if not program_store.enabled():
        return None, "off (KERAUNOS_PROGRAM_STORE=0)", 0.0
    o = state.options
    module = state.module
    dynamic = getattr(_active, "dynamic", None)
    why = None
    if state.forward_only or isinstance(module, torch.fx.GraphModule):
        why = "only the programs of jitted modules and functions are kept"
    elif module is None and type(state.fn) is not types.FunctionType:
        why = f"a jitted {type(state.fn).__qualname__} is not kept (a function or a module is)"
    elif o.transforms:
        why = "a program with Transforms is not kept"
    elif o.cache not in (CacheMode.CONSTANT_VALUES, CacheMode.SYMBOLIC_VALUES):
        why = f"a program of cache={o.cache.value!r} is not kept"
    elif active_ddp_bucket_caps() is not None:
        why = "a program inside DistributedDataParallel is not kept"
    elif module is not None and any(hook_state(module)):
        # The fast prologue made on a load would check the hooks the module has now, not those
        # the program was captured with.
        why = "a module with hooks (or global module hooks) is not kept"
    elif dynamic is not None and dynamic.generating:
        why = "a program called by Hugging Face generate() is not kept"
    if why is not None:
        return None, f"not kept: {why}", 0.0
    options = (tuple(getattr(e, "name", type(e).__qualname__) for e in o.executors),
               o.cache.value, o.specialize_data, o.fallback.value, o.dynamic, o.fuse.value,
               o.min_fused_forward_ops, o.min_shared_layers)
    t0 = time.perf_counter()
    sizes = _predicted_sizes(dynamic)
    try:
        key = program_store.key_of(module if module is not None else state.fn, state.fn,
                                   repr(options), args, kwargs, sizes,
                                   _call_sharing(module, args, kwargs))
    except program_store.Unstorable as e:
        return None, f"not kept: {e}", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the store must never stop a compilation
        return None, f"not kept: the key failed ({type(e).__name__}: {e})", 0.0
    _active.predicted_sizes = sizes
    return key, None, time.perf_counter() - t0


def _call_sharing(module, args, kwargs) -> tuple | None:
    """How the call's tensors and the module's parameters and buffers share memory, for the
    program store's key: two calls that share it otherwise (``f(x, x.view(...))`` and ``f(x,
    y)``) keep programs of their own instead of overwriting one row. (The row's own ``sharing``,
    over what the prologue returned, still decides whether a loaded program serves a call.)"""
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    return storage_alias_pattern(tensors)


def _predicted_sizes(request: DynamicRequest | None) -> DynamicRequest | None:
    """A scratch copy of this compilation's ``DynamicRequest``, which the key asks, before
    capture, which sizes and ints of the call capture will make symbolic: capture asks the real
    one the same questions with the same memory (``seen``), and ``program_to_keep`` checks that
    it answered alike."""
    if request is None:
        return None
    scratch = copy.copy(request)
    scratch.changes, scratch.updated, scratch.any_dynamic = [], {}, False
    return scratch


def load_program(state, key: str, args, kwargs) -> tuple[Compilation | None, str | None]:
    """The compilation kept under ``key``, as ``STAGES`` left it, if its readable prologue
    accepts this call (None otherwise: the program is captured), and why a stored program
    under ``key`` did not serve (None: it did, or there was none)."""
    t0 = time.perf_counter()
    root = state.module if state.module is not None else state.fn
    stored, refused = program_store.load(key, root, args, kwargs)
    if stored is None:
        return None, refused
    program = Program(stored["prologue"], stored["computation"], stored["epilogue"],
                      stored["check_descriptions"])
    c = Compilation(state, program, [stored["prologue"]], [stored["computation"]],
                    [stored["epilogue"]], backwards=[stored["backward"]] if stored["backward"]
                    else [], executors=tuple(state.options.executors), split=stored["split"],
                    loaded=True, facts=stored["facts"], sharing=stored["sharing"])
    c.program_store = "loaded"
    request = getattr(_active, "dynamic", None)
    if request is not None:
        # What capture would have told automatic dynamic, and the miss reasons it would give
        # ("... changed 3 → 5; recompiled with it symbolic"): the key's prediction of them.
        predicted = getattr(_active, "predicted_sizes", None)
        request.updated.update(stored["seen_sizes"])
        if predicted is not None:
            request.changes.extend(predicted.changes)
            request.any_dynamic = request.any_dynamic or predicted.any_dynamic
    c.time("load stored program", time.perf_counter() - t0)
    return c, None


def program_to_keep(c: Compilation) -> dict | str:
    """What the program store keeps of ``c`` (as ``STAGES`` left it), or why nothing is."""
    request = getattr(_active, "dynamic", None)
    predicted = getattr(_active, "predicted_sizes", None)
    if request is not None and predicted is not None and any(
            request.updated.get(path, value) != value
            for path, value in predicted.updated.items()):
        return "not kept: capture made other sizes symbolic than the key foresaw"
    if c.program.keep_alive:
        return "not kept: DTensors"
    split = replace(c.split, place_gradients=None) if c.split is not None else None
    return {"prologue": c.prologues[-1], "computation": c.computation,
            "epilogue": c.epilogues[-1], "backward": c.backward, "split": split,
            "check_descriptions": c.program.check_descriptions, "facts": captured_facts(c),
            # What capture told automatic dynamic (each input's sizes): a load tells it too.
            "seen_sizes": dict(request.updated if request is not None else {})}


def _fuse_mode(c: Compilation) -> FuseMode | None:
    """How this entry's fused program is compiled (None: no fusion executor was asked for).
    ``"background"`` fuses only programs worth it (``tiers.worth_fusing``), and waits instead
    while deterministic algorithms are on; under autocast no region is formed at all (its
    regions would run outside autocast), which the worker thread could not see (thread-local)."""
    if not _fusing(c.executors):
        return None
    mode = c.state.options.fuse
    if mode is not FuseMode.BACKGROUND:
        return mode
    if torch.are_deterministic_algorithms_enabled():
        return FuseMode.WAIT
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available()
                                            and torch.is_autocast_enabled("cuda")):
        return FuseMode.OFF
    fusers = executors_module.fusion_executors(c.executors)
    if not all(getattr(e, "compiles_elsewhere", False) for e in fusers):
        # A fusion executor that compiles only in this process: on the calling thread, never
        # beside it (``runtime/tiers.py``).
        return FuseMode.WAIT
    def computes(b):
        return any(e.computes_in_region(b) for e in fusers)
    min_forward = c.state.options.min_fused_forward_ops
    if not tiers.worth_fusing((c.computation, c.backward), computes) and (
            min_forward is None or not tiers.worth_fusing((c.computation,), computes,
                                                           min_forward)):
        c.fusion_note = (f"not fused: fewer than {tiers.MIN_FUSED_OPS} ops a region would "
                         f"compute (fuse=\"wait\" fuses it anyway)")
        return FuseMode.OFF
    return mode


class _Detached:
    """What the fused tier's stages read of the jitted callable's state: its options. Not the
    state itself, which holds the user's module: the background job must not keep it alive."""

    def __init__(self, options):
        self.options = options


def _fork(c: Compilation) -> Compilation:
    """A copy of ``c`` whose later stages record into lists of their own (the traces so far are
    shared: stages derive new traces, never change one), holding nothing of the user's."""
    # Not the prologues and epilogues, which the fused tier shares with tier 0: the fast
    # prologue's namespace keeps its walk of the user's module tree.
    return replace(c, state=_Detached(c.state.options), program=None, prologues=[],
                   computations=list(c.computations), epilogues=[],
                   backwards=list(c.backwards), stages={}, fusion_regions=[])


def _fused_tier(c: Compilation) -> Compilation:
    """In the background: the fused tier's claims and regions, each region compiled by a helper
    process (``BACKGROUND_STAGES``). Nothing here reads or writes what the user's thread sees."""
    for stage in BACKGROUND_STAGES:
        stage(c)
    return c


def _switcher(state_ref, entry_ref):
    """The switch to the fused tier ``c``, made on the user's thread (``tiers.schedule``): its
    regions' kernels loaded, the stages that may run the user's code (Transforms) or generate
    code, then the entry's program replaced (``_switch``)."""
    def switch(c: Compilation) -> None:
        state, entry = state_ref(), entry_ref()
        if state is None or entry is None:
            return
        if not c.fusion_regions:  # nothing the helpers could compile: tier 0 stays
            why = "; ".join(c.site.refusals) if c.site is not None and c.site.refusals else \
                "no region was formed"
            entry.fusion_note = f"not fused in the background: {why}"
            return
        t0 = time.perf_counter()
        for region in c.fusion_regions:
            region.ready()
        c.time("load fused regions", time.perf_counter() - t0)
        if lint.enabled():  # what the background made, checked here (``core.lint``)
            for trace in (*c.computations, *c.backwards):
                trace.lint()
        for stage in SWITCH_STAGES:
            stage(c)
        t0 = time.perf_counter()
        computation_fn = _computation_callable(c)
        c.time("codegen", time.perf_counter() - t0)
        _switch(state, entry, computation_fn, c)
        native.LOADER.poll()
    return switch


def _switch(state, entry: CacheEntry, computation_fn, c: Compilation) -> None:
    """From the next call on, ``entry`` runs the fused tier: its traces first (what
    ``last_traces`` shows), the callable last, in one assignment that calls read once."""
    entry.computation_traces, entry.backward_traces = c.computations, c.backwards
    entry.fusion_regions = c.fusion_regions
    entry.tiering.stages = dict(c.stages)
    entry.tiering.fused_from_call = state.hits + state.misses
    entry.tiering.tier = "fused"
    entry.computation_fn = computation_fn
    for follower in entry.tiering.followers:  # entries rebound from this one (rebind_entry)
        shared = follower()
        if shared is not None:
            shared.computation_traces, shared.backward_traces = c.computations, c.backwards
            shared.fusion_regions = c.fusion_regions
            shared.computation_fn = computation_fn


def capture(state, args, kwargs) -> Compilation:
    """The program as the user's code ran it: prologue, computation, epilogue traces."""
    # A unit of a fully_shard'ed model is captured from its forward: its call hooks are
    # FSDP2's, which run eagerly around the program (runtime/jitted.py, _jit_fsdp).
    target = state.module if state.module is not None and not state.forward_only else state.fn
    fusing = _fusing(state.options.executors) and state.options.fuse is not FuseMode.OFF
    # A module's capture takes long enough (0.8 s for 32 layers) that the helper processes, which
    # import torch and Inductor for seconds, pay to start beside it when its fused tier will be
    # compiled by them. Not a function's: most are small, never fused.
    if fusing and state.module is not None and state.options.fuse is FuseMode.BACKGROUND:
        for executor in executors_module.fusion_executors(state.options.executors):
            executor.start_helpers()
    program = capture_program(target, state.module, args, kwargs,
                              state.options.cache is not CacheMode.SAME_INPUT,
                              state.options.specialize_data)
    return Compilation(state, program, [program.prologue], [program.computation],
                       [program.epilogue], stages=dict(program.stages),
                       executors=tuple(state.options.executors),
                       bucket_caps=active_ddp_bucket_caps())


def transforms_before_prologue(c: Compilation) -> None:
    """Each Transform's ``transform_traces_pre_prologue`` hook, labelled with its name."""
    for t in c.state.options.transforms:
        t0 = time.perf_counter()
        prologue, computation, epilogue = t.transform_traces_pre_prologue(
            c.prologues[-1], c.computation, c.epilogues[-1])
        seconds = time.perf_counter() - t0
        c.time(f"transform {t.name}", seconds)
        c.prologues.append(prologue.derive(prologue.bound_symbols, t.name, seconds))
        c.computations.append(computation.derive(computation.bound_symbols, t.name, seconds))
        c.epilogues.append(epilogue)


def optimize(c: Compilation) -> None:
    for p in OPTIMIZATIONS:
        c.computations.append(p(c.computation))
        c.time(p.label, c.computation.seconds)


def autograd_split(c: Compilation) -> None:
    """Grad mode on and some input requires grad: a forward trace and a backward trace."""
    if not _needs_backward(c.computation):
        return
    try:
        split = split_forward_backward(c.computation)
        backwards = [split.backward]
        for p in BACKWARD_OPTIMIZATIONS:
            backwards.append(p(backwards[-1]))
        placed = split.place_gradients(backwards[-1])
        placement = placed is not backwards[-1]
        if placement:
            backwards.append(placed)
        if split.symbolic:  # a symbolic size left as a constant would be wrong: no backward then
            for trace in (split.forward, placed):
                refuse_raw_symbols(trace)
    except Exception as e:  # noqa: BLE001 - any op the split cannot handle
        _warn_no_backward(c.state, e)
        return
    split.backward = placed
    c.split = split
    c.computations.append(split.forward)
    c.backwards += backwards
    c.time("autograd split", split.forward.seconds)
    for p, trace in zip(BACKWARD_OPTIMIZATIONS, backwards[1:]):
        c.time(p.label, trace.seconds)
    if placement:
        c.time("autograd split", placed.seconds)


def reinplace_inputs(c: Compilation) -> None:
    """Without autograd involved, inputs written in place are written directly (no copy-back)."""
    if c.backward is not None or not can_reinplace(c.computation):
        return
    computation, epilogue = reinplace(c.computation, c.epilogues[-1])
    if epilogue is not c.epilogues[-1]:
        c.computations.append(computation)
        c.epilogues.append(epilogue)
        c.time("reinplace", computation.seconds)


def functionalize_for_fusion(c: Compilation) -> None:
    """For the fused tier: chains of pointwise writes of one tensor become values and one
    write, so that a region may hold them (``passes/functionalize.py``)."""
    if not _fusing(c.executors) or c.backward is not None:
        return
    computation = functionalize_writes(c.computation)
    if computation.bound_symbols != c.computation.bound_symbols:
        c.computations.append(computation)
        c.time("functionalize writes", computation.seconds)


def executor_claims(c: Compilation) -> None:
    c.records_autograd = c.backward is None and torch.is_grad_enabled()
    executors = c.executors
    c.computations.append(executors_module.claim(c.computation, executors))
    c.time("executor claims", c.computation.seconds)
    if c.backward is not None:
        c.backwards.append(executors_module.claim(c.backward, executors))


def fuse_regions(c: Compilation) -> None:
    """The fusion executors' regions of the forward and backward traces (after the claims)."""
    if not _fusing(c.executors):
        return
    executors, counter = c.executors, [0]  # region names: unique in the entry
    shared = c.state.options.min_shared_layers
    for executor in executors_module.fusion_executors(executors):
        fuse = trace_step(executor.fuse)  # the runner times every executor's traces
        where = {"site": c.site} if getattr(executor, "compiles_elsewhere", False) else {}
        fuse = functools.partial(fuse, **where)
        forward = c.computation
        # The backward's regions start elsewhere while the forward's compile runs.
        if c.segments is not None:
            for segment in c.segments.segments:
                executor.prefetch(segment.trace, observable=_returned(segment.trace),
                                  always_checked=set(), forward=forward,
                                  min_shared_layers=shared, **where)
        elif c.backward is not None:
            executor.prefetch(c.backward, observable=_returned(c.backward),
                              always_checked=_varying_grads(c), forward=forward,
                              min_shared_layers=shared, **where)
        fused, regions = fuse(
            forward, executors, observable=_returned(forward),
            records_autograd=c.records_autograd, counter=counter, min_shared_layers=shared)
        c.fusion_regions += regions
        if fused is not forward:
            c.computations.append(fused)
            c.time("fusion", fused.seconds)
        backward = c.backward
        if backward is None:
            continue
        if c.segments is not None:  # no symbolic strides: the split needs exact sizes
            for segment in c.segments.segments:
                segment.trace, regions = fuse(
                    segment.trace, executors, observable=_returned(segment.trace),
                    forward=forward, counter=counter, min_shared_layers=shared)
                c.fusion_regions += regions
                c.time("fusion", segment.trace.seconds)
            continue
        # The backward's Function lays each incoming gradient out as recorded before the trace
        # runs (autograd/function.py); only gradients of symbolic strides can still come with
        # others, and regions check those (and what is made from them) on every call.
        fused, regions = fuse(
            backward, executors, observable=_returned(backward), always_checked=_varying_grads(c),
            forward=forward, counter=counter, min_shared_layers=shared)
        c.fusion_regions += regions
        if fused is not backward:
            c.backwards.append(fused)
            c.time("fusion", fused.seconds)


def _varying_grads(c: Compilation) -> set[str]:
    """The backward's incoming gradients of symbolic strides."""
    backward = c.backward
    return {p.name for p in backward.params[len(backward.params) - len(c.split.grad_metadata):]
            if not all(type(v) is int for v in p.stride)}


def transforms_after_optimization(c: Compilation) -> None:
    """Each Transform's ``transform_trace_post_optimization`` hook, on the forward and backward."""
    for t in c.state.options.transforms:
        t0 = time.perf_counter()
        computation = t.transform_trace_post_optimization(c.computation)
        forward_seconds = time.perf_counter() - t0
        c.computations.append(computation.derive(computation.bound_symbols, t.name,
                                                 forward_seconds))
        backward_seconds = 0.0
        if c.segments is not None:  # what runs: each segment of the backward
            t0 = time.perf_counter()
            for segment in c.segments.segments:
                transformed = t.transform_trace_post_optimization(segment.trace)
                segment.trace = transformed.derive(transformed.bound_symbols, t.name)
            backward_seconds = time.perf_counter() - t0
        elif c.backward is not None:
            t0 = time.perf_counter()
            backward = t.transform_trace_post_optimization(c.backward)
            backward_seconds = time.perf_counter() - t0
            c.backwards.append(backward.derive(backward.bound_symbols, t.name, backward_seconds))
        # The hook's time on the forward and on the backward, not the labelling between them.
        c.time(f"transform {t.name} (post optimization)", forward_seconds + backward_seconds)


def delete_dead_names(c: Compilation) -> None:
    c.computations.append(delete_last_used(c.computation))
    c.time("delete last used", c.computation.seconds)
    if c.segments is not None:
        for segment in c.segments.segments:
            segment.trace = delete_last_used(segment.trace)
    elif c.backward is not None:
        c.backwards.append(delete_last_used(c.backward))


def split_at_ddp_buckets(c: Compilation) -> None:
    """Inside DistributedDataParallel's forward, the backward becomes one autograd node per
    stretch that completes a bucket of DDP's reducer, so that each bucket's all-reduce starts
    while the rest of the backward runs (``autograd/buckets.py``), as ``torch.compile``'s
    DDPOptimizer does. After the claims, before fusion: the later stages treat each segment as
    a backward of its own, and ``show_segments`` adds the trace that marks the boundaries."""
    c.segments = None
    if c.backward is None or c.bucket_caps is None:
        return
    t0 = time.perf_counter()
    c.segments = plan_segments(c.backward, c.split.forward, c.split.n_saved_tensors,
                               c.bucket_caps)
    c.time("split at DDP's buckets", time.perf_counter() - t0)


def show_segments(c: Compilation) -> None:
    if c.segments is not None:
        c.backwards.append(display_trace(c.segments, c.backward))


def fast_prologue_stage(c: Compilation) -> None:
    prologue, structure_walk = fast_prologue(c.prologues[-1])
    if structure_walk is not None:
        c.prologues.append(structure_walk)
    c.prologues.append(prologue)
    c.time("fast prologue", prologue.seconds)


# What runs after capture, in order; each stage records its traces and time in the Compilation.
# The backward peephole runs before the claims, so that fusion regions see the backward it leaves.
# What they leave is what the program store keeps; the fast prologue follows (``compile_entry``).
STAGES = (transforms_before_prologue, optimize, autograd_split, peephole_stage, reinplace_inputs)
# Then, once per tier: from the claims on. The fused tier of ``fuse="background"`` runs the
# first four in the background (``_fused_tier``), the rest on the user's thread at the switch
# (``_switcher``): Transforms are the user's code.
BACKGROUND_STAGES = (functionalize_for_fusion, executor_claims, split_at_ddp_buckets,
                     fuse_regions)
SWITCH_STAGES = (transforms_after_optimization, delete_dead_names, show_segments)
TIER_STAGES = BACKGROUND_STAGES + SWITCH_STAGES


def make_entry(c: Compilation, tiering: Tiering | None = None) -> CacheEntry:
    """Code generation: the traces become Python functions, held by a new cache entry."""
    t0 = time.perf_counter()
    prologue_fn = c.prologues[-1].python_callable()
    computation_fn = _computation_callable(c)
    epilogue_fn = c.epilogues[-1].python_callable()
    c.time("codegen", time.perf_counter() - t0)
    n_inputs, written = c.facts if c.facts is not None else captured_facts(c)
    positions = tuple(range(n_inputs))
    entry = CacheEntry(prologue_fn=prologue_fn, computation_fn=computation_fn,
                       epilogue_fn=epilogue_fn, prologue_traces=c.prologues,
                       computation_traces=c.computations, epilogue_traces=c.epilogues,
                       backward_traces=c.backwards,
                       check_descriptions=c.program.check_descriptions, stages=c.stages,
                       alias_positions=positions if len(positions) > 1 else None,
                       written_positions=written,
                       fusion_regions=c.fusion_regions, fusion_note=c.fusion_note,
                       tiering=tiering, program_store=c.program_store)
    return entry


def captured_facts(c: Compilation) -> tuple:
    """What make_entry needs of the captured computation: its number of inputs, and which of
    them it writes (``_written_positions``)."""
    captured = c.program.computation
    return len(captured.params), _written_positions(captured)


def _computation_callable(c: Compilation):
    computation_fn = c.computation.python_callable()
    if c.segments is not None:
        device = next(p.device for p in c.split.forward.params if isinstance(p, TensorProxy))
        return make_segmented_computation(
            computation_fn, [s.trace.python_callable() for s in c.segments.segments],
            c.segments, c.split, device)
    if c.backward is not None:
        computation_fn = make_autograd_computation(computation_fn, c.backward.python_callable(),
                                                   c.split)
    return computation_fn


def _fusing(executors) -> bool:
    return any(getattr(e, "is_fusion", False) for e in executors)


def _without_fusion(executors) -> tuple:
    return tuple(e for e in executors if not getattr(e, "is_fusion", False))


def _returned(trace: Trace) -> set[str]:
    """The names a trace hands to its caller (not the tensors a forward saves for backward)."""
    outputs = trace.bound_symbols[-1].args[0]
    return {p.name for p in outputs if isinstance(p, Proxy)}


def _written_positions(computation: Trace) -> tuple | None:
    """The inputs the program writes to (it works on a copy of each), or ``None`` when that is
    not known (an op of unknown effect)."""
    index = {p.name: i for i, p in enumerate(computation.params)}
    written = []
    for b in computation.bound_symbols:
        if OPAQUE in b.tags:
            return None
        if COPY_OF_WRITTEN_INPUT in b.tags:  # capture copies every input written to
            written.append(index[b.args[0].name])
    return tuple(written)


def _needs_backward(computation: Trace) -> bool:
    """Grad mode on and some input requires grad: the entry gets a backward trace, unless the
    program switches grad mode off around all it does (an optimizer's step)."""
    return torch.is_grad_enabled() and any(
        getattr(p, "requires_grad", False) for p in computation.params) and \
        not every_op_without_grad(computation)


def _warn_no_backward(state, error: Exception) -> None:
    if not state.warned_no_backward:
        state.warned_no_backward = True
        warnings.warn(f"keraunos: no backward trace for {state.name} ({type(error).__name__}: "
                      f"{error}); its gradients come from PyTorch's autograd recording the "
                      f"forward's torch ops as they run.", stacklevel=5)
