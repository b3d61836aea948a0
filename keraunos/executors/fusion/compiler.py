"""Compiling a region's FX graph with Inductor, once per distinct region, and calling it exactly.

``compile_fx`` runs inside a ``TracingContext`` whose fake mode has a ``ShapeEnv``, with fake
inputs of the recorded metadata and grad mode off (every region is an inference graph), so
Inductor's AOTAutograd and FX graph caches serve identical regions of later processes from disk.
Within a process, ``Kernel``s are kept by region key: identical layers share one. Across
processes, a region of static sizes whose graph runs alone is kept in keraunos's store as
Inductor's generated module (``kernel_store``), which a later process loads without
``compile_fx``.

Each region's call goes through ``region_call.RegionCall``, which checks on its first call that
the inputs arrive with the strides the kernel was compiled for and that the outputs leave with
the strides the trace says, and then calls the kernel directly (or keeps fixing the strides that
differed).

Where a region is compiled is the caller's ``CompileSite``: in this process, on the calling
thread (``fuse="wait"``, the ``torch.compile`` backend), or in a helper process
(``fuse="background"``: ``workers.compile_elsewhere``), whose generated module this process loads
at the kernel's first ``ready``, on the user's thread. In this process Inductor builds a graph's
C++ kernels with g++ in a pool of worker threads and waits for them when it loads the graph's
wrapper module; that wait is put off (``Kernel.ready``) until the kernel's first call, so that
g++ builds one region's kernels while Inductor lowers the next ones.

After its first call, a region's kernel is called past the wrappers ``compile_fx`` puts around
Inductor's graph (``Kernel.direct``): they switch Dynamo and grad mode off and replay aliases and
input mutations, none of which a region has, and cost about 7 us a call (a sixteenth of a
litgpt decode step's instructions, with six regions). A region that writes an input (a KV cache)
is called past them too: its graph writes in its own kernels, and the direct call counts the
write in the input's version counter, as the wrappers do.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import shutil
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch

from ...core.proxies import TensorProxy
from ...core.runner import stopwatch
from ...torch_internals import dispatch, dynamo, inductor
from . import channels_last, collecting, fx_graph, kernel_store, patches, symbolic, warming, workers

# Inductor options for every region. ``fallback_random``: should a random op ever reach a
# region, it draws from eager's generator, in eager's order. ``emulate_precision_casts``: a
# value rounded to bfloat16 or float16 (``x.to(torch.bfloat16).float()``) is rounded as in
# eager, instead of staying float32 inside the fused kernel (the fuzzer found the difference).
# ``size_asserts`` off: Inductor's code would check every input's sizes and strides on every
# call (``assert_size_stride``, 0.5 to 1 us each: 40 us of a 300 us call of a two-layer model,
# with a region per layer). Here they are known: a region's inputs are the program's inputs,
# whose sizes and strides the prologue (or dynamo's guards, which cover an inlined module's
# parameters) checked, or values made from them by the trace's own lines, whose layouts follow
# from those; ``RegionCall`` checks them all on the first call, and on every call lays out again
# the inputs whose strides may vary (incoming gradients, and what lines outside regions make
# from them: ``fusion._varying_with``). The option also drops Inductor's checks of the strides
# its fallback kernels return inside a region (``torch.compile`` keeps them): a fallback whose
# real strides differ from its meta function's would give wrong values instead of an error.
CONFIG_PATCHES = {"fallback_random": True, "emulate_precision_casts": True,
                  "size_asserts": False}

_kernels: dict[tuple, "Kernel | CompileFailure"] = {}
_kernel_numbers = itertools.count()


@dataclass
class Kernel:
    """One compiled region graph, shared by every region with the same key."""

    compiled: object        # Inductor's callable: (*inputs) -> list of outputs (see ``fn``)
    graph: object           # the FX graph it was compiled from (a copy: compile_fx changes its own)
    number: int             # kernel k{number}, as the traces say
    first_region: str       # the region it was compiled for
    code: str               # Inductor's generated wrapper, with its C++ or Triton kernels
    path: str | None        # where that code lives on disk
    seconds: float          # compile time (with the wait for g++, once ``ready``)
    cache: str              # how it was got: "compiled", "AOTAutograd cache", "FX graph cache",
                            # or STORED (Inductor's module, from keraunos's store)
    guards: list = field(default_factory=list)  # symbolic sizes: facts it assumes (sympy)
    pending: list = field(default_factory=list)  # Inductor's put-off waits for its C++ kernels
    store_key: str | None = None  # its key in keraunos's store (None: not kept there)
    row: bytes | None = None  # a stored module not loaded yet (``compiled`` is None till then)
    _lock: object = field(default_factory=threading.RLock, repr=False)
    _unwrapped: object = field(default=None, repr=False)  # see ``direct``; False: none

    @property
    def fn(self):
        """The compiled callable, once its C++ kernels are built (``ready``)."""
        self.ready()
        return self.compiled

    def ready(self) -> None:
        """Load the kernel's module if it is not loaded yet (on the user's thread: see
        ``CompileSite``), and wait for the kernels g++ is still building (raises what the load
        or the build raised)."""
        if self.compiled is None:
            self._load()
        if not self.pending:
            return
        with self._lock, stopwatch() as elapsed, patches.applied():
            while self.pending:
                wait, scope = self.pending[0]
                wait(scope)  # puts the built kernels into the wrapper module's globals
                self.pending.pop(0)
            self.seconds += elapsed()


    def _load(self) -> None:
        with self._lock, stopwatch() as elapsed, patches.applied():
            if self.compiled is not None:
                return
            warming.probe_vector_isa()  # the module's C++ loads pick the vector ISA
            with collecting.from_inductor() as (_, pending):
                loaded = kernel_store.load(self.store_key, self.row)
            if loaded is None:
                raise NotCompiledElsewhere("the module the helper made did not load")
            call, code, path, writes = loaded
            for wait, scope in pending:  # its C++ kernels, built by the helper: loads
                wait(scope)
            if not isinstance(self.graph, torch.fx.GraphModule):
                self.graph = fx_graph.graph_module(self.graph)
            self.code, self.path, self.row = code, path, None
            self._unwrapped = False  # ``compiled`` is already the module's own call
            self.compiled = _stored_call(call, writes)
            self.seconds += elapsed()

    def inputs_it_writes(self, args) -> dict[int, torch.Tensor]:
        """Copies of the inputs the compiled graph writes (a KV cache and its length, BatchNorm's
        statistics), taken before the region's first call for ``direct``'s check: the graph may
        read what it writes (a cache's length, then the positions after it), so running it again
        on the written inputs would compute from their new values."""
        return {} if self._unwrapped is not None else inputs_written_by(self.compiled, args)

    def direct(self, args, outs, grad_free: bool = False, before: dict | None = None):
        """The kernel as a callable past ``compile_fx``'s wrappers, or ``compiled`` where that is
        not known to give the same outputs. Decided once, on a region's first call: ``outs`` are
        what the wrapped kernel gave for ``args`` (``before``: the inputs it wrote, as they were
        before, from ``inputs_it_writes``); the unwrapped graph must give outputs of the
        same layouts, none of them an input or requiring grad (a region is a pure inference
        graph: nothing for the wrappers to replay). A call still goes through the wrappers when
        Dynamo is evaluating frames (a jitted call inside a torch.compile'd function) or grad
        mode is on, which the wrappers would switch off; ``grad_free`` (no input of the region
        requires grad, as the checks before it guarantee: the prologue's, or Dynamo's guards)
        drops the second condition: with no input requiring grad, grad mode changes nothing
        the graph computes."""
        if self._unwrapped is None:
            self._unwrapped = _unwrapped(self.compiled, args, outs, before or {}) or False
            if self._unwrapped is not False and self.store_key is not None:
                # the graph alone gives what the wrappers give: a later process may load it
                kernel_store.save(self.store_key, self._unwrapped)
        graph, compiled = self._unwrapped, self.compiled
        if graph is False:
            return compiled
        return _twins(_counting_writes(graph), lambda args: compiled(*emptied(args)),
                      _outside_dynamo if grad_free else _outside_dynamo_without_grad)


def _outside_dynamo() -> bool:
    return _eval_frame_callback() is None


def _outside_dynamo_without_grad() -> bool:
    return _eval_frame_callback() is None and not _grad_enabled()


def _twins(run, wrapped, direct_now):
    """A region's kernel as a call of its inputs, ``call(*inputs)``, and as ``call.take(list)``
    (``RegionCall.take``), both emptying the list they hand on: ``run`` (Inductor's own call, a
    list of inputs) where ``direct_now()``, else ``wrapped`` (the same with what the wrappers do
    around it)."""
    def call(*args):
        return run(list(args)) if direct_now() else wrapped(list(args))

    def take(args: list):
        return run(args) if direct_now() else wrapped(args)
    call.take = take
    return call


def emptied(args: list) -> tuple:
    """The items of ``args``, which is left empty (a caller that handed its inputs over holds
    them no more)."""
    items = tuple(args)
    args.clear()
    return items


def _counting_writes(graph):
    """Inductor's graph as a callable of a list of inputs. A graph that writes inputs (a KV
    cache) writes them in its C++ kernels, unseen by autograd: the inputs' version counters go
    up by one a call, as AOTAutograd's wrappers do, and as eager's one in-place op does
    (autograd compares the versions of the tensors it saved)."""
    call, written = graph.current_callable, tuple(sorted(graph.mutated_input_idxs))
    if not written:
        return call

    def run(args):
        inputs = [args[i] for i in written]  # (the graph empties its list of inputs)
        outs = call(args)
        _increment_version(inputs)
        return outs
    return run


_eval_frame_callback = dynamo.eval_frame_callback
_increment_version = dispatch.increment_version
_grad_enabled = torch.is_grad_enabled


def inputs_written_by(compiled, args) -> dict[int, torch.Tensor]:
    """Copies of those of ``args`` that the graph inside ``compiled`` writes, by position."""
    graph = _find_in_closures(compiled, inductor.CompiledFxGraph)
    return {i: _copy_of(args[i]) for i in getattr(graph, "mutated_input_idxs", None) or ()
            if i < len(args) and _has_own_layout(args[i])}


def _unwrapped(compiled, args, outs, before):
    """Inductor's ``CompiledFxGraph`` inside ``compiled`` (found through the wrappers' closures),
    when calling it on ``args`` gives outputs like ``outs`` (a graph whose input writes the
    wrappers make returns the new values as more outputs); else None. ``before`` holds copies
    of the inputs the graph writes as they were before the call that gave ``outs``."""
    graph = _find_in_closures(compiled, inductor.CompiledFxGraph)
    if graph is None or getattr(graph, "current_callable", None) is None:
        return None
    if any(isinstance(t, torch.Tensor) and (t.requires_grad or any(t is a for a in args))
           for t in outs):
        return None
    # An output that is a view of an input (or of another output) is a view the wrappers make
    # again on every call (AOTAutograd replays aliases); the graph alone would give a copy, and
    # a later write through it would miss the input (fuzzer with fusion, 94:11).
    sharing = _sharing(args, outs)
    if sharing is None:
        return None
    given = list(args)
    if graph.mutated_input_idxs:  # a KV cache or BatchNorm's statistics, which the graph writes
        # (the write AOTAutograd kept in the graph: one it makes itself comes back as one more
        # output, below). The real inputs were written once, by the call through the wrappers:
        # the graph writes copies of them, of the same layouts, and an output that comes back
        # as a written input's own buffer (an output cloned from it, fuzzer with fusion, 94:81)
        # shows as sharing the copy's memory. The copies are of the values before the first
        # call (``before``): a graph that reads what it writes (a static cache's length, then
        # the positions after it) computes from them what it computed then. Inputs sharing
        # memory with each other may have been merged into one by AOTAutograd (its synthetic
        # bases): those keep the wrappers.
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len({a.untyped_storage()._cdata for a in tensors}) != len(tensors):
            return None
        for i in graph.mutated_input_idxs:
            if i not in before:
                return None  # (an expanded tensor has no copy of its own layout)
            given[i] = before[i]
    with torch.no_grad():
        again = graph.current_callable(list(given))
    if len(again) != len(outs):
        return None
    for a, b in zip(again, outs):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return None
        if isinstance(a, torch.Tensor) and (a.shape, a.stride(), a.dtype, a.device) != (
                b.shape, b.stride(), b.dtype, b.device):
            return None
    return graph if _sharing(given, again) == sharing else None


def _has_own_layout(t) -> bool:
    """Whether ``t`` is a tensor a copy of the same sizes and strides can stand for (an expanded
    tensor, with a stride 0 over a size above 1, has none)."""
    return isinstance(t, torch.Tensor) and not any(
        s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))


def _copy_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s sizes, strides and values in memory of its own."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _sharing(args, outs) -> tuple | None:
    """For each output, the position of an earlier output whose memory it shares (None: its
    own); None when an output shares an input's memory."""
    inputs = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
    first: dict[int, int] = {}
    pattern = []
    for i, t in enumerate(outs):
        if not isinstance(t, torch.Tensor):
            pattern.append(None)
            continue
        key = t.untyped_storage()._cdata
        if key in inputs:
            return None
        pattern.append(first.get(key))
        first.setdefault(key, i)
    return tuple(pattern)


def _find_in_closures(fn, kind, depth: int = 12):
    """The first object of ``kind`` reached from ``fn`` through ``__wrapped__`` and closure
    cells, breadth first, at most ``depth`` levels down."""
    level, seen = [fn], set()
    for _ in range(depth):
        following = []
        for f in level:
            if isinstance(f, kind):
                return f
            if id(f) in seen:
                continue
            seen.add(id(f))
            wrapped = getattr(f, "__wrapped__", None)
            if wrapped is not None:
                following.append(wrapped)
            for cell in getattr(f, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if callable(value) and not isinstance(value, type):
                    following.append(value)
        level = following
    return None


@dataclass
class CompileFailure:
    error: Exception


def environment() -> tuple:
    """What besides the graph and its inputs decides the compiled code: CPU kernels bake the
    thread count in; the default dtype, determinism flag, torch version and Inductor's config
    (its entries this process changed: ``inductor_config_changes``). Read on the user's thread."""
    return (torch.get_num_threads(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), torch.__version__,
            repr(sorted(inductor_config_changes().items())),
            tuple(sorted(CONFIG_PATCHES.items())))


def inductor_config_changes() -> dict:
    """Inductor's config entries this process set away from their defaults: {} when nothing of
    Inductor was imported yet (then it has the defaults, which a helper process starts with too;
    reading them would import dynamo, a second on a restart's first call). A helper
    process applies these on top of its own defaults (``workers``)."""
    config = inductor.config_if_imported()
    if config is None:
        return {}
    overridden = inductor.config_overridden()
    if overridden is None:  # (another torch: every entry, keyed alike everywhere)
        return config.save_config_portable()
    names = [name for name, entry, value in overridden if value != _fresh_value(entry)]
    if not names:  # (serializing the config imports Inductor's lowering from torch 2.15)
        return {}
    portable = config.save_config_portable()
    return {name: portable[name] for name in names if name in portable}


def _fresh_value(entry):
    """What a config entry holds in a process that never set it: its default, or what the
    environment made it (``TORCHINDUCTOR_*``), as a helper process started with this one's
    environment has it. (A value set and set back is not a change.)"""
    unset = inductor.config_unset()
    for value in (getattr(entry, "env_value_force", unset),
                  getattr(entry, "env_value_default", unset)):
        if value is not unset:
            return value
    return getattr(entry, "default", None)


@dataclass(frozen=True)
class CompileSite:
    """Where a fused tier's regions are compiled, and what of the user's process their compile
    depends on, read on the user's thread when the compile was asked for.

    ``elsewhere``: in the helper processes (``workers``), from a description of each region;
    this process only loads what they made, and only on the user's thread (``Kernel.ready``).
    The thread that forms the regions and waits for the helpers reads keraunos's own traces and
    this snapshot, nothing the user's thread can change or see."""

    elsewhere: bool
    environment: tuple
    settings: dict
    # Why regions were not compiled elsewhere (``NotCompiledElsewhere``), for ``compile_stats``.
    refusals: list = field(default_factory=list, compare=False)

    @staticmethod
    def here() -> "CompileSite":
        return CompileSite(False, environment(), {})

    @staticmethod
    def in_helpers() -> "CompileSite":
        return CompileSite(True, environment(), workers.settings(inductor_config_changes()))


def prefetch(key: tuple, graph, inputs: list[TensorProxy], layout_choice,
             site: CompileSite | None = None) -> None:
    """Hand the compile of a region of ``key`` (its FX ``graph``) to a helper process ahead of
    ``kernel_for`` (``workers``): a region not compiled in this process yet, nor kept in the
    store, of static sizes on the CPU. With a site that compiles ``elsewhere`` it is always
    sent (``kernel_for`` then waits for it); otherwise only while the machine has cores to
    spare, and the region is compiled here if no helper took it yet."""
    if key in _kernels:
        return
    store_key = kernel_store.key_of(key)
    if store_key is None or kernel_store.has(store_key):
        return
    elsewhere = site is not None and site.elsewhere
    workers.prefetch(store_key, graph, inputs, layout_choice, dict(CONFIG_PATCHES),
                     site.settings if elsewhere else None, always=elsewhere)


def kernel_for(key: tuple, make_graph, inputs: list[TensorProxy], outputs: list[TensorProxy],
               region_name: str, layout: symbolic.Layout | None = None,
               graph=None, layout_choice: bool | None = None,
               site: CompileSite | None = None) -> tuple["Kernel | CompileFailure", bool]:
    """The kernel for ``key`` and whether it was already there (compiled for another region);
    ``make_graph()`` builds the region's FX graph module, only when it must be compiled;
    ``graph``: an FX graph of the region already built (for the key), shown as the kernel's,
    and ``layout`` the inputs' ``symbolic.Layout``, when the caller has them;
    ``layout_choice``: Inductor's ``layout_optimization`` for it (``channels_last``).
    With a ``site`` that compiles ``elsewhere``, the kernel comes from a helper process (or the
    store) and is loaded by its first ``ready``, on the user's thread."""
    found = _kernels.get(key)
    if found is not None:
        return found, True
    store_key = kernel_store.key_of(key)
    if site is not None and site.elsewhere:
        kernel = _from_elsewhere(store_key, graph, inputs, region_name, layout_choice, site)
        if not isinstance(kernel, CompileFailure):
            _kernels.setdefault(key, kernel)
        return kernel, False
    # A helper compiling it ahead hands its generated module back (and fills the caches).
    row = workers.wait_for(store_key) if store_key is not None else None
    kernel = _load_stored(store_key, make_graph, region_name, graph, row) if store_key else None
    if kernel is None:
        try:
            kernel = _compile(make_graph, inputs, outputs, region_name,
                              layout or symbolic.Layout(inputs), graph, layout_choice)
            kernel.store_key = store_key
        except Exception as e:  # noqa: BLE001 - whatever Inductor raises, the region runs on torch
            kernel = CompileFailure(e)
    _kernels[key] = kernel
    return kernel, False


class NotCompiledElsewhere(Exception):
    """A region the helper processes do not compile (symbolic sizes, not the CPU, a graph whose
    generated module alone does not reproduce it), or whose compile there failed. ``expected``:
    a kind of region they never compile, which is no news to warn about."""

    def __init__(self, message: str, expected: bool = False):
        super().__init__(message)
        self.expected = expected


def _from_elsewhere(store_key, graph, inputs, region_name, layout_choice,
                    site: CompileSite) -> "Kernel | CompileFailure":
    """A kernel not loaded yet, whose module a helper process generated (or one kept in the
    store); on a thread other than the user's, this reads the store and waits for the helper,
    nothing else."""
    if store_key is None:
        return CompileFailure(NotCompiledElsewhere(
            "symbolic sizes or not the CPU: compiled only where the program runs "
            "(fuse=\"wait\")", expected=True))
    with stopwatch() as elapsed:
        row = kernel_store.stored(store_key)
        cache = STORED
        if row is None:
            answer = workers.compile_elsewhere(store_key, graph, inputs, layout_choice,
                                               dict(CONFIG_PATCHES), site.settings)
            if not answer.ok:
                return CompileFailure(NotCompiledElsewhere(
                    answer.reason, expected=answer.reason.startswith("Refused")))
            row, cache = answer.row, "compiled in a helper process"
    return Kernel(None, graph, next(_kernel_numbers), region_name, "", None, elapsed(), cache,
                  [], [], store_key, row=row)


STORED = "keraunos store"


def _load_stored(store_key: str, make_graph, region_name: str, graph=None,
                 row: bytes | None = None) -> Kernel | None:
    """The kernel a process before this one compiled for the same key, from Inductor's module
    kept in keraunos's store (``kernel_store``), or the ``row`` a helper just made: no
    ``compile_fx``; None when there is neither."""
    with stopwatch() as elapsed, patches.applied():
        data = row if row is not None else kernel_store.stored(store_key)
        if data is None:
            return None
        warming.probe_vector_isa()  # the module's C++ loads pick the vector ISA: never two at once
        with collecting.from_inductor() as (_, pending):
            loaded = kernel_store.load(store_key, data)
        if loaded is None:
            return None
        call, code, path, writes = loaded
        shown = fx_graph.graph_module(graph) if graph is not None else make_graph()
    kernel = Kernel(_stored_call(call, writes), shown, next(_kernel_numbers), region_name, code,
                    path, elapsed(), STORED, [], pending, store_key)
    kernel._unwrapped = False  # ``compiled`` is already the module's own call
    return kernel


def _stored_call(call, writes: tuple = ()):
    """A stored module's ``call`` as ``compile_fx``'s callables are called (``*inputs``), with
    what its wrappers do where it matters: grad mode off, Dynamo kept out (a jitted call inside
    a torch.compile'd function must not trace Inductor's generated code), and the version
    counters of the inputs it writes counted up (``_counting_writes``)."""
    if writes:
        plain = call

        def call(args):
            inputs = [args[i] for i in writes]  # (the module empties its list of inputs)
            outs = plain(args)
            _increment_version(inputs)
            return outs

    @dynamo.disable
    def wrapped(args):
        with torch.no_grad():
            return call(args)

    return _twins(call, wrapped, _outside_dynamo_without_grad)


def _compile(make_graph, inputs, outputs, region_name, layout, graph=None,
             layout_choice: bool | None = None) -> Kernel:
    """Compile the region in this process, on the calling thread (the user's: ``fuse="wait"``,
    or the ``torch.compile`` backend's compile)."""
    from ...torch_internals.dynamo import counters
    from ...torch_internals.fake import FakeTensorMode, ShapeEnv, TracingContext, tracing
    from ...torch_internals.inductor import PyCodeCache, compile_fx
    with stopwatch() as elapsed, patches.applied(compiling=True):
        gm = make_graph()  # compile_fx changes the graph it compiles: the one shown is another
        shown = fx_graph.graph_module(graph) if graph is not None else make_graph()
        shape_env = fx_graph.shape_env(inputs)  # the capture's, when sizes are symbolic
        if shape_env is not None and layout.unbound:
            raise SymbolicUnguardable(f"sizes {sorted(map(str, layout.unbound))} "
                                      f"that no input dimension gives")
        compile_env = symbolic.private_copy(shape_env) if shape_env is not None else None
        fake_mode = FakeTensorMode(
            shape_env=compile_env if compile_env is not None else ShapeEnv())
        fakes = fx_graph.fake_inputs(inputs, fake_mode, layout)
        fx_graph.propagate(gm, fakes, fake_mode, outputs)
        warming.before_the_first_pick()
        before = _cache_counts(counters)
        with torch.no_grad(), tracing(TracingContext(fake_mode)), \
                channels_last.inductor_layout(layout_choice), \
                collecting.from_inductor() as (sources, pending):
            fn = compile_fx(gm, fakes, ignore_shape_env=shape_env is None,
                            config_patches=dict(CONFIG_PATCHES))
        # Facts about the sizes that Inductor assumed beyond the prologue's checks (``4 < s0``):
        # each call checks them (``RegionCall``), and runs the region's own lines where one fails.
        guards = symbolic.added_facts(compile_env) if compile_env is not None else []
        after = _cache_counts(counters)
        cache = ("AOTAutograd cache" if after[0] > before[0] else
                 "FX graph cache" if after[1] > before[1] else "compiled")
        code = sources[-1] if sources else ""
        path = PyCodeCache.write(code)[1] if code else None
    return Kernel(fn, shown, next(_kernel_numbers), region_name, code, path,
                  elapsed(), cache, guards, pending)


class SymbolicUnguardable(Exception):
    """Inductor assumed facts about sizes that the region's inputs do not give to check."""


def _cache_counts(counters) -> tuple[int, int]:
    return (counters["aot_autograd"].get("autograd_cache_hit", 0),
            counters["inductor"].get("fxgraph_cache_hit", 0))


@functools.lru_cache(maxsize=None)
def toolchain_problem(device_type: str) -> str | None:
    """Why Inductor cannot build kernels for ``device_type`` here (``None``: it can)."""
    if device_type == "cuda":
        from ...torch_internals.inductor import has_triton
        return None if has_triton() else "Triton is not installed"
    try:
        from ...torch_internals.inductor import get_cpp_compiler
        compiler = get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - Inductor's own search failed
        return f"no C++ compiler found ({e})"
    if shutil.which(compiler) is None:
        return f"the C++ compiler {compiler!r} is not on PATH"
    try:
        subprocess.run([compiler, "-x", "c++", "-fsyntax-only", "-"], input=b"int main() {}\n",
                       check=True, capture_output=True, timeout=60)
    except Exception as e:  # noqa: BLE001 - any failure means it cannot build kernels
        return f"the C++ compiler {compiler!r} does not work ({type(e).__name__}: {e})"
    return None


_warned: set[str] = set()
_exiting = False


@atexit.register
def _note_exiting() -> None:
    global _exiting
    _exiting = True


def warn_once(message: str) -> None:
    """Warn once per process: a missing compiler concerns every compilation alike. Not while
    the process exits: a fused tier compiling then fails for that reason alone (runtime/tiers.py).
    On a thread that keeps its warnings for the user's (``kept_warnings``), the message is
    kept: ``warnings.warn`` reads the filters the user's thread may be changing."""
    if _exiting or sys.is_finalizing():
        return
    kept = getattr(_keeping, "messages", None)
    if kept is not None:
        kept.append(message)
        return
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=2)


_keeping = threading.local()


class kept_warnings:
    """Within it, this thread's ``warn_once`` messages are kept in ``messages`` instead of
    warned; ``warn_once`` them later on the user's thread."""

    def __enter__(self) -> list:
        self.messages = _keeping.messages = []
        return self.messages

    def __exit__(self, *exc) -> bool:
        _keeping.messages = None
        return False
