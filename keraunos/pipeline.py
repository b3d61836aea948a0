"""Compilation on a cache miss: capture, transforms, passes, the autograd split, executors,
code generation. Every stage's trace is kept (``last_traces`` and friends) with its time."""
from __future__ import annotations

import time
import warnings

import torch

from . import executors as executors_module
from .autograd import make_autograd_computation, split_forward_backward
from .cache import CacheEntry, CacheMode
from .capture.program import capture_program
from .core.proxies import Proxy
from .core.tags import OPAQUE
from .core.trace import Trace
from .executors import fusion
from .executors.prologue_cache import fast_prologue
from .passes import common_subexpression_elimination, dead_code_elimination, delete_last_used
from .passes.reinplace import can_reinplace, reinplace

# The computation's passes, in order. Each takes a trace and returns a new one.
PIPELINE = (dead_code_elimination, common_subexpression_elimination, dead_code_elimination)


def compile_entry(state, args: tuple, kwargs: dict) -> CacheEntry:
    check_values = state.options.cache is not CacheMode.SAME_INPUT
    target = state.module if state.module is not None else state.fn
    fusing = any(getattr(e, "is_fusion", False) for e in state.options.executors)
    with fusion.tagging_layers(state.module if fusing else None):
        program = capture_program(target, state.module, args, kwargs, check_values,
                                  state.options.specialize_data)
    stages = dict(program.stages)
    prologue, computation, epilogue = program.prologue, program.computation, program.epilogue
    prologue_traces, computation_traces, epilogue_traces = [prologue], [computation], [epilogue]
    for t in state.options.transforms:
        t0 = time.perf_counter()
        prologue, computation, epilogue = t.transform_traces_pre_prologue(
            prologue, computation, epilogue)
        seconds = time.perf_counter() - t0
        stages[f"transform {t.name}"] = seconds
        prologue = prologue.derive(prologue.bound_symbols, t.name, seconds)
        computation = computation.derive(computation.bound_symbols, t.name, seconds)
        prologue_traces.append(prologue)
        computation_traces.append(computation)
        epilogue_traces.append(epilogue)
    for p in PIPELINE:
        computation = p(computation)
        label = computation.header[-1].split(" (")[0].removeprefix("Constructed by ")
        stages[label] = stages.get(label, 0.0) + computation.seconds  # DCE runs twice: summed
        computation_traces.append(computation)
    backward = None
    split = None
    if _needs_backward(computation):
        try:
            split = split_forward_backward(computation)
        except Exception as e:  # noqa: BLE001 - any op the split cannot handle
            _warn_no_backward(state, e)
        else:
            computation, backward = split.forward, split.backward
            computation_traces.append(computation)
            stages["autograd split"] = computation.seconds
    if backward is None and can_reinplace(computation):
        computation, new_epilogue = reinplace(computation, epilogue)
        if new_epilogue is not epilogue:
            epilogue = new_epilogue
            computation_traces.append(computation)
            epilogue_traces.append(epilogue)
            stages["reinplace"] = computation.seconds
    records_autograd = backward is None and torch.is_grad_enabled()
    computation = executors_module.claim(computation, state.options.executors)
    computation_traces.append(computation)
    stages["executor claims"] = computation.seconds
    backward_traces = []
    if backward is not None:
        backward_traces.append(backward)
        backward = executors_module.claim(backward, state.options.executors)
        backward_traces.append(backward)
    fusion_regions = []
    if fusing:
        computation, backward, fusion_regions = _fuse(
            computation, backward, split, state.options.executors, records_autograd, stages,
            computation_traces, backward_traces)
    for t in state.options.transforms:
        t0 = time.perf_counter()
        computation = t.transform_trace_post_optimization(computation)
        forward_seconds = time.perf_counter() - t0
        computation = computation.derive(computation.bound_symbols, t.name, forward_seconds)
        computation_traces.append(computation)
        backward_seconds = 0.0
        if backward is not None:
            t0 = time.perf_counter()
            backward = t.transform_trace_post_optimization(backward)
            backward_seconds = time.perf_counter() - t0
            backward = backward.derive(backward.bound_symbols, t.name, backward_seconds)
            backward_traces.append(backward)
        # The hook's time on the forward and on the backward, not the labelling between them.
        stages[f"transform {t.name} (post optimization)"] = forward_seconds + backward_seconds
    computation = delete_last_used(computation)
    computation_traces.append(computation)
    stages["delete last used"] = computation.seconds
    if backward is not None:
        backward = delete_last_used(backward)
        backward_traces.append(backward)
    prologue, structure_walk = fast_prologue(prologue)
    if structure_walk is not None:
        prologue_traces.append(structure_walk)
    prologue_traces.append(prologue)
    stages["fast prologue"] = prologue.seconds
    t0 = time.perf_counter()
    prologue_fn = prologue.python_callable()
    computation_fn = computation.python_callable()
    if backward is not None:
        computation_fn = make_autograd_computation(computation_fn, backward.python_callable(),
                                                   split)
    epilogue_fn = epilogue.python_callable()
    stages["codegen"] = time.perf_counter() - t0
    positions = tuple(range(len(program.computation.params)))
    entry = CacheEntry(prologue_fn, computation_fn, epilogue_fn, prologue_traces,
                       computation_traces, epilogue_traces, backward_traces,
                       program.check_descriptions, None, stages,
                       alias_positions=positions if len(positions) > 1 else None,
                       written_positions=_written_positions(program.computation))
    entry.fusion_regions = fusion_regions  # keraunos.last_fusions, KERAUNOS_DEBUG=3, report
    return entry


def _fuse(computation, backward, split, executors, records_autograd, stages,
          computation_traces, backward_traces):
    """The fusion executors' regions of the forward and backward traces (after the claims)."""
    counter = [0]  # region names are unique within the entry
    forward = computation
    computation, regions = fusion.fuse(
        forward, executors, observable=_returned(forward), records_autograd=records_autograd,
        counter=counter)
    if computation is not forward:
        computation_traces.append(computation)
        stages["fusion"] = computation.seconds
    if backward is not None:
        grads = {p.name for p in backward.params[len(backward.params) - len(split.grad_metadata):]}
        names = fusion.layers.layers_of_names(
            forward, fusion.layers.layer_of_lines(forward.bound_symbols))
        fused, backward_regions = fusion.fuse(
            backward, executors, observable=_returned(backward), always_checked=grads,
            layer_of_name=names, counter=counter)
        if fused is not backward:
            backward = fused
            backward_traces.append(backward)
            stages["fusion"] = stages.get("fusion", 0.0) + backward.seconds
        regions += backward_regions
    return computation, backward, regions


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
        if b.info.get("copy_of_written_input"):  # capture copies every input written to
            written.append(index[b.args[0].name])
    return tuple(written)


def _needs_backward(computation: Trace) -> bool:
    """Grad mode on and some input requires grad: the entry gets a backward trace."""
    return torch.is_grad_enabled() and any(
        getattr(p, "requires_grad", False) for p in computation.params)


def _warn_no_backward(state, error: Exception) -> None:
    if not state.warned_no_backward:
        state.warned_no_backward = True
        warnings.warn(f"keraunos: no backward trace for {state.name} ({type(error).__name__}: "
                      f"{error}); its gradients come from PyTorch's autograd recording the "
                      f"forward's torch ops as they run.", stacklevel=5)
