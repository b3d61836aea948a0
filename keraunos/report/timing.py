"""Per-call stage timings for the report: the call path (``keraunos/runtime/call.py``) timed step by step, the
original (eager) program for comparison, and the ops inside the computation under
``torch.profiler``."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..runtime.call import get_computation_and_inputs, maybe_call_epilogue, state_of

STEPS = ("get_computation_and_inputs", "computation_fn", "maybe_call_epilogue")
PROFILED_CALLS = 10


@dataclass
class CallTimings:
    calls: int
    steps: dict[str, float]          # step -> median seconds per call
    total: float                     # median seconds of a whole call
    eager: float | None              # median seconds of the original program
    top_ops: list[tuple[str, int, float]] = field(default_factory=list)  # name, calls, s/call
    profiled: int = PROFILED_CALLS   # calls the op table averages over


def _one_call(state, args, kwargs) -> list[float]:
    t0 = time.perf_counter()
    entry, inputs, pro_to_epi = get_computation_and_inputs(state, args, kwargs)
    t1 = time.perf_counter()
    result = entry.computation_fn(*inputs)
    t2 = time.perf_counter()
    maybe_call_epilogue(entry, result, pro_to_epi)
    t3 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t3 - t0]


def _median_eager(target, args, kwargs, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        target(*args, **kwargs)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_calls(jitted, args: tuple, kwargs: dict, calls: int = 50,
               profile_ops: bool = True) -> CallTimings:
    """Run the jitted callable ``calls`` times (after a few warm-up calls) and time each step;
    then the original program as many times; then a few calls under ``torch.profiler``."""
    state = state_of(jitted)
    for _ in range(3):
        _one_call(state, args, kwargs)
    samples = [_one_call(state, args, kwargs) for _ in range(calls)]
    columns = list(zip(*samples))
    steps = {name: statistics.median(col) for name, col in zip(STEPS, columns)}
    target = state.module if state.module is not None else state.fn
    eager = _median_eager(target, args, kwargs, calls)
    top = _top_ops(state, args, kwargs) if profile_ops else []
    return CallTimings(calls, steps, statistics.median(columns[-1]), eager, top)


def _top_ops(state, args, kwargs, calls: int = PROFILED_CALLS, count: int = 12):
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use costs
            _one_call(state, args, kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                with torch.profiler.record_function("keraunos.call"):
                    _one_call(state, args, kwargs)
        rows = [e for e in prof.key_averages() if not e.key.startswith("keraunos.")]
        rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        return [(e.key, e.count // calls, e.self_cpu_time_total * 1e-6 / calls)
                for e in rows[:count]]
    except Exception:  # noqa: BLE001 - the profiler is a bonus; the step timings stand alone
        return []
