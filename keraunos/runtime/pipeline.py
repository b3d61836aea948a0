"""Compilation on a cache miss: capture, the stages (``stages.py``), the tiers
(``fused_tier.py``), code generation (``codegen.py``); a program kept by the program store
(``keeping.py``) standing in for capture. Every stage's trace is kept (``last_traces`` and
friends) with its time."""
from __future__ import annotations

import weakref

from .. import debug
from .. import executors as executors_module
from ..autograd.buckets import active_ddp_bucket_caps
from ..capture.program import capture_program
from ..persist import programs as program_store
from . import fused_tier, keeping, native
from .cache import CacheEntry, CacheMode, sharing_of
from .codegen import make_entry
from .compilation import Compilation, CompileRequest
from .stages import STAGES, TIER_STAGES, fast_prologue_stage, fusing, without_fusion
from .tiers import FuseMode, Tiering


def compile_entry(state, args, kwargs, request: CompileRequest | None = None) -> CacheEntry:
    """Capture the program, run every stage in ``STAGES`` order, then the fast prologue, the
    claims and what follows them (``TIER_STAGES``) once per tier: the entry holds it all. With
    fusion in the background, the entry runs tier 0 (no fusion executors) and switches to the
    fused tier when the worker has compiled it (``tiers.py``). A program kept by the program
    store whose readable prologue accepts the call stands in for capture and ``STAGES``; a
    captured one is kept there. ``request``: what the miss asks beyond the call (symbolic
    sizes)."""
    request = request if request is not None else CompileRequest()
    native.LOADER.poll()  # a native hit path built in the background is imported here
    key, why_not, key_seconds = keeping.program_key(state, args, kwargs, request)
    c, refused = (keeping.load_program(state, key, args, kwargs, request) if key is not None
                  else (None, None))
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
    c = capture(state, args, kwargs, request)
    for stage in STAGES:
        stage(c)
    kept, note = None, why_not
    if key is not None:
        c.time("program key", key_seconds)
        kept, note = keeping.program_to_keep(c)
    refusal = f"; the stored program was refused ({refused})" if refused is not None else ""
    c.program_store = note + refusal
    entry = _finish(state, c, args, kwargs)
    if kept is not None:
        kept, why = keeping.with_sharing(kept, entry, args, kwargs)
        if kept is None:
            entry.program_store = why
    if kept is not None:
        # Pickling the 32-layer model's program takes 0.2-0.5 s: not before the first result.
        # The traces are done (passes derive new ones); the module tree's paths are taken now.
        entry_ref = weakref.ref(entry)

        def kept_note(note: str) -> None:
            kept_entry = entry_ref()
            if kept_entry is not None:
                kept_entry.program_store = note + refusal
        program_store.keep_in_background(key, kept, state.module if state.module is not None
                                         else state.fn, kept_note, owner=state)
    return entry


class _StoredProgramRejected(Exception):
    """A loaded program's fast prologue rejected the call its readable prologue accepted, or
    the call's inputs share memory otherwise than the capturing call's did."""


def _finish(state, c: Compilation, args, kwargs) -> CacheEntry:
    """The fast prologue, the tiers, code generation: the entry."""
    fast_prologue_stage(c)
    mode = fused_tier.choose(c)
    if mode is FuseMode.BACKGROUND:
        fused = fused_tier.fork(c)
        c.executors = without_fusion(c.executors)
    elif mode is FuseMode.OFF:
        c.executors = without_fusion(c.executors)
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
        fused_tier.schedule(fused, state, entry)
    return entry


def capture(state, args, kwargs, request: CompileRequest) -> Compilation:
    """The program as the user's code ran it: prologue, computation, epilogue traces."""
    # A unit of a fully_shard'ed model is captured from its forward: its call hooks are
    # FSDP2's, which run eagerly around the program (jitted.py, _jit_fsdp).
    target = state.module if state.module is not None and not state.forward_only else state.fn
    fuses = fusing(state.options.executors) and state.options.fuse is not FuseMode.OFF
    # A module's capture takes long enough (0.8 s for 32 layers) that the helper processes, which
    # import torch and Inductor for seconds, pay to start beside it when its fused tier will be
    # compiled by them. Not a function's: most are small, never fused.
    if fuses and state.module is not None and state.options.fuse is FuseMode.BACKGROUND:
        for executor in executors_module.fusion_executors(state.options.executors):
            executor.start_helpers()
    program = capture_program(target, state.module, args, kwargs,
                              state.options.cache is not CacheMode.SAME_INPUT,
                              state.options.specialize_data, dynamic=request.dynamic)
    return Compilation(state, program, [program.prologue], [program.computation],
                       [program.epilogue], stages=dict(program.stages),
                       executors=tuple(state.options.executors),
                       bucket_caps=active_ddp_bucket_caps(), request=request)
