"""The program store's part of a compilation (``persist/programs.py`` keeps and loads): the key
of a miss, the stored program that stands in for capture and ``STAGES``, and what of a captured
compilation is kept."""
from __future__ import annotations

import copy
import time
import types
from dataclasses import replace

import torch
import torch.utils._pytree as pytree

from ..autograd.buckets import active_ddp_bucket_caps
from ..capture.program import Program
from ..capture.symbolic import DynamicRequest
from ..persist import programs as program_store
from ..persist.programs import StoredProgram
from .cache import CacheEntry, CacheMode, sharing_of, storage_alias_pattern
from .codegen import captured_facts
from .compilation import Compilation, CompileRequest
from .structure import hook_state


def program_key(state, args, kwargs, request: CompileRequest
                ) -> tuple[str | None, str | None, float]:
    """The program store's key for this compilation, or None and why it is not kept; what
    making the key took. With sizes that may be symbolic (``request.dynamic``), the key holds
    which are, decided as capture decides them: ``request.predicted`` (``_predicted_sizes``)."""
    request.predicted = None
    if not program_store.enabled():
        return None, "off (KERAUNOS_PROGRAM_STORE=0)", 0.0
    o = state.options
    module = state.module
    dynamic = request.dynamic
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
                                   call_sharing(module, args, kwargs))
    except program_store.Unstorable as e:
        return None, f"not kept: {e}", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the store must never stop a compilation
        return None, f"not kept: the key failed ({type(e).__name__}: {e})", 0.0
    request.predicted = sizes
    return key, None, time.perf_counter() - t0


def call_sharing(module, args, kwargs) -> tuple | None:
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


def load_program(state, key: str, args, kwargs, request: CompileRequest
                 ) -> tuple[Compilation | None, str | None]:
    """The compilation kept under ``key``, as ``STAGES`` left it, if its readable prologue
    accepts this call (None otherwise: the program is captured), and why a stored program
    under ``key`` did not serve (None: it did, or there was none)."""
    t0 = time.perf_counter()
    root = state.module if state.module is not None else state.fn
    stored, refused = program_store.load(key, root, args, kwargs)
    if stored is None:
        return None, refused
    program = Program(stored.prologue, stored.computation, stored.epilogue,
                      stored.check_descriptions)
    c = Compilation(state, program, [stored.prologue], [stored.computation], [stored.epilogue],
                    backwards=[stored.backward] if stored.backward else [],
                    executors=tuple(state.options.executors), split=stored.split, loaded=True,
                    facts=stored.facts, sharing=stored.sharing, request=request)
    c.program_store = "loaded"
    dynamic, predicted = request.dynamic, request.predicted
    if dynamic is not None:
        # What capture would have told automatic dynamic, and the miss reasons it would give
        # ("... changed 3 → 5; recompiled with it symbolic"): the key's prediction of them.
        dynamic.updated.update(stored.seen_sizes)
        if predicted is not None:
            dynamic.changes.extend(predicted.changes)
            dynamic.any_dynamic = dynamic.any_dynamic or predicted.any_dynamic
    c.time("load stored program", time.perf_counter() - t0)
    return c, None


def program_to_keep(c: Compilation) -> tuple[StoredProgram | None, str]:
    """What the program store keeps of ``c`` (as ``STAGES`` left it), or None and why
    nothing is. (Its ``sharing`` is the entry's: ``with_sharing``.)"""
    dynamic, predicted = c.request.dynamic, c.request.predicted
    if dynamic is not None and predicted is not None and any(
            dynamic.updated.get(path, value) != value
            for path, value in predicted.updated.items()):
        return None, "not kept: capture made other sizes symbolic than the key foresaw"
    if c.program.keep_alive:
        return None, "not kept: DTensors"
    split = replace(c.split, place_gradients=None) if c.split is not None else None
    return StoredProgram(
        c.prologues[-1], c.computation, c.epilogues[-1], c.backward, split,
        c.program.check_descriptions, captured_facts(c),
        # What capture told automatic dynamic (each input's sizes): a load tells it too.
        dict(dynamic.updated if dynamic is not None else {})), "keeping (pickled in the background)"


def with_sharing(kept: StoredProgram, entry: CacheEntry, args, kwargs
                 ) -> tuple[StoredProgram | None, str | None]:
    """``kept`` with how this call's inputs share memory (``cache.sharing_of``): a load serves
    only calls whose inputs share it alike (``pipeline.compile_entry``); or None and why not."""
    r = entry.prologue_fn(*args, **kwargs)
    if type(r) is not tuple:  # the miss path reports it (a prologue that rejects its own call)
        return None, "not kept: its prologue rejects the call it was captured on"
    return replace(kept, sharing=sharing_of(entry, r[0])), None
