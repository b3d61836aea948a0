"""One compiled program for identical modules: an entry compiled for one FSDP2 unit made to
serve another of the same class (``rebind_entry``), so that a model of identical blocks compiles
once per distinct layer, as ``torch.compile`` shares one graph between them. ``runtime/call.py`` tries
this before compiling a unit's miss (``_entry_of_an_identical_unit``); ``runtime/jitted.py`` says which
units form a family."""
from __future__ import annotations

import time
import weakref
from dataclasses import replace

import torch

from .cache import CacheEntry, sharing_of
from ..core.proxies import Proxy
from ..core.trace import Trace
from ..capture.retarget import expecting_values_of, with_example
from .fast_prologue import FastPrologue, fast_prologue
from .structure import _GLOBAL_HOOK_TABLES, _HOOK_TABLES, hook_state


def rebind_entry(entry: CacheEntry, module: torch.nn.Module, to: torch.nn.Module,
                 args: tuple, kwargs: dict, own_hooks_in_program: bool) -> CacheEntry | None:
    """``entry``, compiled for ``module``, made to serve this call of ``to``: the same
    computation, backward and epilogue callables, behind a prologue of its own that reads and
    checks ``to``; None unless that prologue accepts the call and its inputs share memory as
    those of the call ``entry`` was compiled on did.

    Why that is sound: the readable prologue reaches every module value through its ``module``
    name (paths, attributes, submodule types, parameter metadata, hooks), so run on ``to`` it
    checks everything the program assumed of ``module``; objects it checks by identity (a
    config object) must be the very same ones, and the hooks the program runs (those of the
    submodules; ``own_hooks_in_program``: ``to``'s own too) the same functions. Where the
    argument does not hold, None: a trace that names one of ``module``'s own objects directly
    (a submodule, parameter or buffer), a prologue the fast prologue did not write. An entry
    whose fused tier is compiling gets the rebound one switched with it
    (``Tiering.followers``). The fast prologue's C++ tensor checks are built from example tensors:
    here ``to``'s, once the readable checks passed and they are of the same type and dispatch
    keys as the compiling call's (plain tensors, where those are gone)."""
    made = entry.fast_prologue
    if not isinstance(made, FastPrologue) or made.walk is None:
        return None
    readable = made.readable
    if readable.namespace.get("module") is not module:
        return None
    owned = {id(module)} | {id(x) for x in (*module.modules(), *module.parameters(),
                                            *module.buffers())}
    named = [v for k, v in readable.namespace.items() if k != "module"]
    for trace in (entry.computation_traces[-1:] + entry.backward_traces[-1:]
                  + entry.epilogue_traces[-1:]):
        named += list(trace.namespace.values())
    if any(id(v) in owned for v in named):
        return None
    if not _same_hooks(made.walk.hooks, hook_state(to), own_hooks_in_program):
        return None
    t0 = time.perf_counter()
    note = (f"Rebound to another {type(to).__qualname__} (an identical module: one compiled "
            f"program for both)")
    lines = [expecting_values_of(b, to) for b in readable.bound_symbols]
    namespace = {**readable.namespace, "module": to}
    checked = Trace(readable.name, list(readable.params), lines, list(readable.header), namespace)
    accepted = checked.python_callable()(*args, **kwargs)
    if type(accepted) is not tuple:
        return None
    value_of = {p.name: v for p, v in zip(lines[-1].args[0], accepted[0])
                if isinstance(p, Proxy)}
    lines = [with_example(b, value_of) for b in lines]
    if any(b is None for b in lines):
        return None
    rebound = Trace(readable.name, list(readable.params), lines, readable.header + [note],
                    namespace)
    remade = fast_prologue(rebound)
    prologue_fn = remade.trace.python_callable()
    r = prologue_fn(*args, **kwargs)
    # The inputs must share memory as those of the call it was compiled on did: no prologue
    # line checks that (cache.sharing_of).
    if type(r) is not tuple or sharing_of(entry, r[0]) != entry.alias_pattern:
        return None
    shared = replace(entry, prologue_fn=prologue_fn, prologue_traces=[rebound, *remade.traces],
                     fast_prologue=remade,
                     stages={"rebind to an identical module": time.perf_counter() - t0},
                     alias_pattern=None, hits=0, alias_check=CacheEntry.alias_check,
                     hit_fn=CacheEntry.hit_fn, hit_trace=None, check_seconds=0.0,
                     native_hit=CacheEntry.native_hit)
    if entry.tiering is not None:
        entry.tiering.followers.append(weakref.ref(shared))
        shared.computation_fn = entry.computation_fn  # the switch may have come meanwhile
    return shared


def _same_hooks(compiled: tuple | None, now: tuple, own_hooks: bool) -> bool:
    """Whether a module runs the hooks the program was compiled with: the same global hooks,
    and its submodules' (with ``own_hooks``, its own too: else they are FSDP2's, run around
    the program, not in it) the same functions in the same order. Hook handles differ between
    modules; the functions must not."""
    if compiled is None or len(compiled) != len(now):
        return False
    n_global, n_own = len(_GLOBAL_HOOK_TABLES), len(_HOOK_TABLES)
    if compiled[:n_global] != now[:n_global]:
        return False
    start = n_global if own_hooks else n_global + n_own
    return all(len(a) == len(b) and all(x[1] is y[1] for x, y in zip(a, b))
               for a, b in zip(compiled[start:], now[start:]))
