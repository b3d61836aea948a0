"""Which tier a compilation's entry starts on, and the fused tier of ``fuse="background"``:
forked from the compilation on the user's thread, its stages run on keraunos's background
thread, and switched to on the user's thread (``tiers.py`` says how the tiers work)."""
from __future__ import annotations

import time
import weakref
from dataclasses import replace

import torch

from .. import executors as executors_module
from ..core import lint
from . import native, tiers
from .cache import CacheEntry
from .codegen import computation_callable
from .compilation import Compilation
from .stages import BACKGROUND_STAGES, SWITCH_STAGES, fusing
from .tiers import FuseMode

def choose(c: Compilation) -> FuseMode | None:
    """How this entry's fused program is compiled (None: no fusion executor was asked for).
    ``"background"`` fuses only programs worth it (``tiers.worth_fusing``), and waits instead
    while deterministic algorithms are on. Under autocast too: capture wrote autocast's casts
    as lines of the trace (``capture/recorder.py``), so the background thread, where autocast
    is off, forms the same regions."""
    if not fusing(c.executors):
        return None
    mode = c.state.options.fuse
    if mode is not FuseMode.BACKGROUND:
        return mode
    if torch.are_deterministic_algorithms_enabled():
        return FuseMode.WAIT
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


def fork(c: Compilation) -> Compilation:
    """A copy of ``c`` whose later stages record into lists of their own (the traces so far are
    shared: stages derive new traces, never change one), holding nothing of the user's."""
    # Not the prologues and epilogues, which the fused tier shares with tier 0: the fast
    # prologue's namespace keeps its walk of the user's module tree.
    return replace(c, state=_Detached(c.state.options), program=None, prologues=[],
                   computations=list(c.computations), epilogues=[],
                   backwards=list(c.backwards), stages={}, fusion_regions=[],
                   fast_prologue=None)


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
        computation_fn = computation_callable(c)
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


def schedule(fused: Compilation, state, entry: CacheEntry) -> None:
    """The fused tier ``fused`` (``fork``) compiled in the background for ``entry`` of the
    jitted callable ``state``, and switched to on the user's thread when it is done. What the
    helpers' compiles depend on is read now, on the user's thread."""
    fused.site = next(e for e in executors_module.fusion_executors(fused.executors)
                      if e.compiles_elsewhere).compile_site(True)
    tiers.schedule(entry.tiering, lambda: _fused_tier(fused),
                   _switcher(weakref.ref(state), weakref.ref(entry)), entry, state)
