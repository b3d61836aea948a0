"""The stages of a compilation after capture, in order: each reads the latest traces of a
``Compilation`` and records the ones it makes (``Compilation.record``), labelled and timed.

``STAGES`` run once (what the program store keeps is what they leave); ``TIER_STAGES`` once per
tier (``fused_tier.py``): the fused tier's ``BACKGROUND_STAGES`` on keraunos's background
thread, its ``SWITCH_STAGES`` on the user's thread at the switch."""
from __future__ import annotations

import functools
import time
import warnings

import torch

from .. import executors as executors_module
from ..autograd import split_forward_backward
from ..autograd.in_program import expand_backwards, has_backward
from ..autograd.buckets import display_trace, plan_segments
from ..core import glue
from ..core.proxies import Proxy, TensorProxy
from ..core.runner import trace_pass, trace_step
from ..core.symbolic import refuse_raw_symbols
from ..core.trace import Trace
from ..errors import BackwardInProgramError
from ..passes import common_subexpression_elimination, dead_code_elimination, delete_last_used
from ..passes.functionalize import functionalize_writes
from ..passes.peephole import peephole_stage
from ..passes.reinplace import can_reinplace, every_op_without_grad, reinplace
from .compilation import Compilation
from .fast_prologue import fast_prologue

OPTIMIZATIONS = (dead_code_elimination, common_subexpression_elimination, dead_code_elimination)


@trace_pass("Common Subexpression Elimination (backward)")
def _backward_cse(trace: Trace) -> list:
    """CSE of the backward, where two lines may give the same gradient (``distinct_outputs``)."""
    return common_subexpression_elimination.__wrapped__(trace, distinct_outputs=False)


# The backward's optimization passes, in order, after the autograd split.
BACKWARD_OPTIMIZATIONS = (_backward_cse, dead_code_elimination)


def transforms_before_prologue(c: Compilation) -> None:
    """Each Transform's ``transform_traces_pre_prologue`` hook, labelled with its name."""
    for t in c.state.options.transforms:
        t0 = time.perf_counter()
        prologue, computation, epilogue = t.transform_traces_pre_prologue(
            c.prologues[-1], c.computation, c.epilogues[-1])
        seconds = time.perf_counter() - t0
        c.record(f"transform {t.name}", seconds=seconds,
                 prologue=prologue.derive(prologue.bound_symbols, t.name, seconds),
                 computation=computation.derive(computation.bound_symbols, t.name, seconds),
                 epilogue=epilogue)


def backwards_in_program(c: Compilation) -> None:
    """A backward the program runs itself (a training step): expanded into its forward and
    backward, in line (``autograd/in_program.py``); the program then runs without autograd."""
    if not has_backward(c.computation):
        return
    try:
        computation = expand_backwards(c.computation)
    except Exception as e:  # noqa: BLE001 - any program the split cannot handle: the fallback
        raise BackwardInProgramError(
            f"keraunos cannot compile the backward inside {c.state.name} "
            f"({type(e).__name__}: {e}).\n  What to do: keep the default fallback=\"dynamo\", "
            f"which runs the step with the graphs around the backward compiled; or jit the "
            f"model and run the backward outside it.") from e
    c.record(expand_backwards.label, computation=computation)


def optimize(c: Compilation) -> None:
    for p in OPTIMIZATIONS:
        c.record(p.label, computation=p(c.computation))


def drop_unused_inputs(c: Compilation) -> None:
    """Gradients (``x.grad`` inputs) the optimized computation no longer reads, which
    ``zero_grad`` only compared with ``None``, are still checked by the prologue but not handed
    on: a caller holding them would keep their memory alive for the whole call. (Other inputs
    are held by their owners anyway.)"""
    computation, prologue = c.computation, c.prologues[-1]
    read = {p.name for b in computation.bound_symbols for p in b.input_proxies()}
    kept = [p for p in computation.params if not isinstance(p, TensorProxy) or p.name in read
            or not (p.provenance or "").endswith(".grad")]
    returned = prologue.bound_symbols[-1]
    if len(kept) == len(computation.params) or returned.symbol is not glue.RETURN_INPUTS or \
            [getattr(p, "name", p) for p in returned.args[0]] != \
            [getattr(p, "name", p) for p in computation.params]:
        return
    t0 = time.perf_counter()
    label = "Unused inputs not handed on"
    lines = prologue.bound_symbols[:-1] + [returned.replace(args=(kept, returned.args[1]))]
    seconds = time.perf_counter() - t0
    c.dropped_inputs = frozenset(p.name for p in computation.params if p not in kept)
    c.record(label, seconds=seconds, prologue=prologue.derive(lines, label, seconds),
             computation=computation.derive(computation.bound_symbols, label, seconds,
                                            params=kept))


def autograd_split(c: Compilation) -> None:
    """Grad mode on and some input requires grad: a forward trace and a backward trace."""
    if not _needs_backward(c.computation):
        return
    try:
        split = split_forward_backward(_without_releases(c.computation))
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


def _without_releases(computation: Trace) -> Trace:
    """The computation without its ``x.grad = None`` lines, which a forward recorded by autograd
    leaves to the epilogue's write."""
    lines = [b for b in computation.bound_symbols if b.symbol is not glue.RELEASE_GRAD]
    if len(lines) == len(computation.bound_symbols):
        return computation
    return computation.derive(lines, "released gradients left to the epilogue")


def reinplace_inputs(c: Compilation) -> None:
    """Without autograd involved, inputs written in place are written directly (no copy-back)."""
    if c.backward is not None or not can_reinplace(c.computation):
        return
    computation, epilogue = reinplace(c.computation, c.epilogues[-1])
    if epilogue is not c.epilogues[-1]:
        c.record("reinplace", computation=computation, epilogue=epilogue)


def functionalize_for_fusion(c: Compilation) -> None:
    """For the fused tier: chains of pointwise writes of one tensor become values and one
    write, so that a region may hold them (``passes/functionalize.py``)."""
    if not fusing(c.executors) or c.backward is not None:
        return
    computation = functionalize_writes(c.computation)
    if computation.bound_symbols != c.computation.bound_symbols:
        c.record("functionalize writes", computation=computation)


def executor_claims(c: Compilation) -> None:
    c.records_autograd = c.backward is None and torch.is_grad_enabled() and \
        not every_op_without_grad(c.computation)
    executors = c.executors
    c.record("executor claims", computation=executors_module.claim(c.computation, executors))
    if c.backward is not None:
        c.backwards.append(executors_module.claim(c.backward, executors))


def fuse_regions(c: Compilation) -> None:
    """The fusion executors' regions of the forward and backward traces (after the claims)."""
    if not fusing(c.executors):
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
            c.record("fusion", computation=fused)
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
            c.record("fusion", backward=fused)


def _varying_grads(c: Compilation) -> set[str]:
    """The backward's incoming gradients of symbolic strides."""
    backward = c.backward
    return {p.name for p in backward.params[len(backward.params) - len(c.split.grad_metadata):]
            if not all(type(v) is int for v in p.stride)}


def transforms_after_optimization(c: Compilation) -> None:
    """Each Transform's ``transform_trace_post_optimization`` hook, on the forward and on the
    backward that runs (each segment of it, where it is split at DDP's buckets)."""
    for t in c.state.options.transforms:
        def transformed(trace: Trace, t=t) -> Trace:
            t0 = time.perf_counter()
            made = t.transform_trace_post_optimization(trace)
            return made.derive(made.bound_symbols, t.name, time.perf_counter() - t0)
        computation = transformed(c.computation)
        c.record(f"transform {t.name} (post optimization)", computation=computation,
                 seconds=computation.seconds + c.each_backward(transformed))


def delete_dead_names(c: Compilation) -> None:
    c.record("delete last used", computation=delete_last_used(c.computation))
    # The backward takes its saved tensors boxed (``autograd/function.py``): they go too.
    c.each_backward(lambda t: delete_last_used(t, params_too=c.segments is None))


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
    """The prologue a hit runs, compiled from the readable one (``fast_prologue.py``): its
    traces (the module walk's, then its own), and its record, which the entry keeps."""
    made = fast_prologue(c.prologues[-1])
    c.fast_prologue = made
    c.prologues += made.traces
    c.time("fast prologue", made.trace.seconds)


# What runs after capture, in order; each stage records its traces and time in the Compilation.
# The backward peephole runs before the claims, so that fusion regions see the backward it leaves.
# What they leave is what the program store keeps; the fast prologue follows (``compile_entry``).
STAGES = (backwards_in_program, transforms_before_prologue, optimize, drop_unused_inputs,
          autograd_split,
          peephole_stage, reinplace_inputs)


# Then, once per tier: from the claims on. The fused tier of ``fuse="background"`` runs the
# first four in the background (``_fused_tier``), the rest on the user's thread at the switch
# (``_switcher``): Transforms are the user's code.
BACKGROUND_STAGES = (functionalize_for_fusion, executor_claims, split_at_ddp_buckets,
                     fuse_regions)


SWITCH_STAGES = (transforms_after_optimization, delete_dead_names, show_segments)


TIER_STAGES = BACKGROUND_STAGES + SWITCH_STAGES


def fusing(executors) -> bool:
    return any(getattr(e, "is_fusion", False) for e in executors)


def without_fusion(executors) -> tuple:
    return tuple(e for e in executors if not getattr(e, "is_fusion", False))


def _returned(trace: Trace) -> set[str]:
    """The names a trace hands to its caller (not the tensors a forward saves for backward)."""
    outputs = trace.bound_symbols[-1].args[0]
    return {p.name for p in outputs if isinstance(p, Proxy)}


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
