"""What a jitted callable compiled and how it ran: its last entry's traces and fused regions, the
cache counters and miss reasons, ``compile_stats``, and ``wait_for_fusion``. The package exports
all of these (``keraunos.last_traces`` ...)."""
from __future__ import annotations

import time

from .core.trace import Trace
from .runtime.call import CompileStats, state_of


def _last_entry(jitted):
    entry = state_of(jitted).last_entry
    if entry is None:
        raise RuntimeError("keraunos: this jitted callable has not been called yet, so it has "
                           "no traces; call it once first")
    return entry


def last_traces(jitted) -> list[Trace]:
    """The computation traces of the cache entry that ran last: one per pass, in order."""
    return _last_entry(jitted).computation_traces


def last_prologue_traces(jitted) -> list[Trace]:
    """The prologue traces of the cache entry that ran last."""
    return _last_entry(jitted).prologue_traces


def last_epilogue_traces(jitted) -> list[Trace]:
    """The epilogue traces of the cache entry that ran last."""
    return _last_entry(jitted).epilogue_traces


def last_backward_traces(jitted) -> list[Trace]:
    """The backward traces of the cache entry that ran last, one per step (empty when it has no
    backward: grad mode was off, or no input requires grad)."""
    return _last_entry(jitted).backward_traces


def last_fusions(jitted) -> list:
    """The fused regions of the cache entry that ran last (``executors=["inductor", "torch"]``):
    each with its ``name``, ``inputs`` and ``outputs``, its own ``trace``, the FX ``graph`` handed
    to Inductor, and Inductor's generated code (``kernel_code``, ``kernel_path``); ``source``
    holds all of it as one text. Empty when nothing was fused.

        >>> j = keraunos.jit(model, executors=["inductor", "torch"])  # doctest: +SKIP
        >>> _ = j(x)  # doctest: +SKIP
        >>> print(keraunos.last_fusions(j)[0].source)  # doctest: +SKIP
    """
    return list(getattr(_last_entry(jitted), "fusion_regions", None) or ())


def cache_hits(jitted) -> int:
    return state_of(jitted).hits


def cache_misses(jitted) -> int:
    return state_of(jitted).misses


def last_cache_miss_reasons(jitted) -> list[str]:
    """For the last cache miss: why each existing entry did not fit, one sentence per entry."""
    return list(state_of(jitted).last_miss_reasons)


def compile_stats(jitted) -> CompileStats:
    """Per-stage compile times of the entry that ran last, the last call's cache lookup time
    (on a miss, without the compilation) and whether it compiled, the cache counters, and which
    tier ran the last call (``tier``: "torch" or "fused"; for a fused program compiled in the
    background, ``fused_from_call``: the calls before the switch, ``fusion_seconds``, its
    stages, ``fusion_pending``)."""
    state = state_of(jitted)
    entry = state.last_entry
    stages = dict(entry.stages) if entry else {}
    calls = state.hits + state.misses
    compiled = state.misses > 0 and state.compiled_at_call == calls
    stats = CompileStats(stages, state.last_lookup, state.hits, state.misses, compiled)
    if entry is None:
        return stats
    stats.fusion_note = getattr(entry, "fusion_note", None)
    stats.program_store = getattr(entry, "program_store", None)
    stats.hit_path = _hit_path(state, entry)
    stats.tier = "fused" if getattr(entry, "fusion_regions", None) else "torch"
    tiering = getattr(entry, "tiering", None)
    if tiering is not None:
        switched = tiering.fused_from_call
        stats.tier = "fused" if switched is not None and calls > switched else "torch"
        stats.fused_from_call, stats.fusion_stages = switched, dict(tiering.stages) or None
        # Pending while the background compiles; once it is done the next call switches.
        stats.fusion_seconds, stats.fusion_pending = tiering.seconds, not tiering.compiled.is_set()
        if tiering.error is not None:
            stats.fusion_note = (f"the fused compile failed ({type(tiering.error).__name__}: "
                                 f"{tiering.error})")
    if stats.tier == "fused":
        from .executors.fusion import one_build
        stats.kernel_build = one_build.describe()
    return stats


def _hit_path(state, entry) -> str:
    """Which hit path serves ``entry``'s calls: "native", or "python (<why>)"."""
    from .runtime import native
    from .runtime.cache import NOT_ASKED
    if state.native_front is None:
        why = native.unavailable() if native.LOADER.module is None else (
            "this callable's calls go through hooks, a profiler or a distributed wrapper")
    elif not state.entries or entry is not state.entries[0]:
        why = "the native hit path serves the first cache entry; this one is later"
    elif entry.native_hit is NOT_ASKED:
        why = "the native hit path has not met this entry yet"
    elif entry.native_hit is None:
        why = entry.native_note or "its prologue is not one the native hit path takes"
    else:
        return "native"
    return f"python ({why})"


def wait_for_fusion(jitted, timeout: float | None = None) -> bool:
    """Wait until the fused programs the cache entries of ``jitted`` are compiling in the
    background (``fuse="background"``) are ready and switched to; the next call runs fused.
    Returns False if ``timeout`` seconds passed first. For benchmarks and tests: a program
    never needs to call it. A program that fell back to ``torch.compile(backend="keraunos")``
    waits for its subgraphs' fused programs."""
    from .runtime.tiers import wait_for_fusion as wait
    state = state_of(jitted)
    states = [state]
    if state.dynamo_compiled is not None:
        from .dynamo.backend import subgraphs_of
        states += [subgraph.jitted._keraunos for subgraph in subgraphs_of(jitted)]
    deadline = None if timeout is None else time.perf_counter() + timeout
    for s in states:
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if not wait(s, left):
            return False
    return True
