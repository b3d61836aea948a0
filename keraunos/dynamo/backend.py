"""The torch.compile backend: one keraunos-jitted GraphModule per FX graph dynamo hands over."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ..runtime.cache import CacheEntry
from ..core import glue
from ..core.trace import Trace
from ..runtime.jitted import jit
from ..torch_internals import autograd as autograd_internals, dynamo, functorch
from ..torch_internals.fx import LazyGraphModule
from ..transforms import Transform
from .sources import UserSourceLines
from .vmap import has_vmap_regions, rewrite_vmap_regions


@dataclass(frozen=True)
class GraphBreak:
    """Where dynamo split the program, and why (dynamo's own words)."""

    filename: str
    lineno: int
    reason: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}: {self.reason.splitlines()[0]}"


@dataclass
class SubgraphTraces:
    """The traces of one subgraph's cache entry that ran last: each list has one trace per pass,
    in order (``forward[-1]`` is what runs); ``backward`` is empty without autograd."""

    name: str
    forward: list[Trace]
    backward: list[Trace]
    prologue: list[Trace]
    graph_module: torch.fx.GraphModule


BACKEND_MIN_FUSED_OPS = 3  # see CompiledSubgraph.__init__
BACKEND_MIN_SHARED_LAYERS = 4  # likewise
_compile_order = itertools.count()  # subgraphs are listed in the order dynamo compiled them


class CompiledSubgraph:
    """What dynamo calls in place of one FX graph: the graph, jitted by keraunos."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, executors, transforms,
                 graph_break: GraphBreak | None, fuse: str | None = None):
        self.gm = gm  # dynamo's graph, as it is: what the eager fallback runs
        if has_vmap_regions(gm):
            gm = rewrite_vmap_regions(copy.deepcopy(gm))
        # A lazy GraphModule writes its generated code into attributes on its first call:
        # capture would record those writes and the epilogue would replay them on every call.
        LazyGraphModule.force_recompile(gm)
        self.name = name
        self.order = next(_compile_order)
        self.eager = False  # keraunos could not compile the graph: dynamo's FX graph runs as is
        self.graph_break = graph_break  # the break that ended this graph, if one did
        self.dynamic = _is_dynamic(gm)
        # Dynamo's guards already checked a static graph's inputs; a dynamic one accepts many
        # sizes under one set of guards, and keraunos compiles (and checks) each.
        cache = "constant values" if self.dynamic else "same input"
        transforms = [UserSourceLines(gm), *(transforms or ())]
        # fallback="error": a graph keraunos cannot capture runs eagerly (_run_eagerly), never
        # through a torch.compile nested in dynamo's own.
        self.jitted = jit(gm, executors=executors, transforms=transforms, cache=cache,
                          max_cache_entries=64 if self.dynamic else 8, fallback="error",
                          fuse=fuse)
        # Graphs whose forward has three ops a region would compute are fused too (in the
        # background unless fuse says otherwise; keraunos.jit wants six in some trace):
        # torch.compile's user asked for compilation, and three pointwise ops cost less per call
        # as one kernel than as eager's three (``(x * 2 + 1).relu()`` in grad mode: 89k
        # instructions a call against 132k unfused and 118k through Inductor's route). Only the
        # forward counts: an MLP whose forward is one relu between two linears, fused for its
        # backward's three, cost 11k more a call than unfused.
        # Regions are cut at layers only where a graph calls BACKEND_MIN_SHARED_LAYERS of one
        # kind: sharing one layer's kernel saves compile time in proportion to the layers, while
        # each cut costs every call a region call (a Python call of an Inductor module and its
        # buffers). A 2-layer decode step cut into 4 regions ran 1.12-1.14x Inductor's whole-graph
        # step; as one region 1.01-1.04x (docs/benchmarks.md). keraunos.jit keeps 2: its
        # users are promised fast compiles, torch.compile's Inductor's per-call speed.
        state = self.jitted._keraunos
        state.options = dataclasses.replace(state.options,
                                            min_fused_forward_ops=BACKEND_MIN_FUSED_OPS,
                                            min_shared_layers=BACKEND_MIN_SHARED_LAYERS)
        # What later calls run, once compiled: the entry's functions without keraunos's call
        # path around them (see lean_call). None until then, and for a dynamic graph.
        self.run = None

    def __call__(self, *args):
        """The calls before ``run`` is set (see ``_bind``): keraunos's whole call path."""
        return self._compile_and_call(args)

    def _bind(self, run) -> None:
        """Later calls go to ``run`` without a frame of this class: dynamo calls this object,
        and a class of its own whose ``__call__`` is ``run`` (a static method) hands the call
        straight on (a Python ``__call__`` that called ``run`` cost 0.9k instructions a call)."""
        self.run = run
        self.__class__ = type(CompiledSubgraph.__name__, (CompiledSubgraph,),
                              {"__call__": staticmethod(run), "__slots__": (),
                               "__module__": CompiledSubgraph.__module__})

    def _compile_and_call(self, args: tuple):
        """The calls before ``run`` is set: keraunos's whole call path, which compiles."""
        if self.eager:
            return self.gm(*args)
        state = self.jitted._keraunos
        misses, entry = state.misses, state.last_entry
        depth = _functorch_depth()
        try:
            out = self.jitted(*args)
        except Exception as error:
            if state.misses == misses or state.last_entry is not entry:
                raise  # it compiled: what failed is the program itself, as it would in eager
            # Dynamo's graph enters vmap (transformers' mask functions) with explicit calls; a
            # capture that failed inside left those levels entered.
            _unwind_functorch(depth)
            return self._run_eagerly(args, error)
        if not self.dynamic and not state.options.profile and state.entries:
            tiering = state.entries[0].tiering
            if tiering is None or tiering.done.is_set():  # lean_call binds the computation:
                self._bind(lean_call(state.entries[0], len(args), self.jitted))  # the final tier's
        return out

    def _run_eagerly(self, args, error: Exception):
        """keraunos could not compile this graph (an op capture does not handle, say): run the
        FX graph as PyTorch does, which also raises eager's error if the program has one."""
        out = self.gm(*args)
        self.eager = True
        self._bind(self.gm)
        warnings.warn(f"keraunos.dynamo: {self.name} runs eagerly (its FX graph, uncompiled): "
                      f"keraunos could not compile it ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''})", UserWarning,
                      stacklevel=3)
        return out

    def traces(self) -> SubgraphTraces | None:
        entry = self.jitted._keraunos.last_entry
        if entry is None or self.eager:
            return None
        return SubgraphTraces(self.name, list(entry.computation_traces),
                              list(entry.backward_traces), list(entry.prologue_traces), self.gm)


def lean_call(entry: CacheEntry, n_args: int, jitted):
    """What dynamo can call in place of a static graph's ``jitted`` callable, whose cache entry
    is ``entry`` (compiled with ``cache="same input"``: its prologue checks nothing, dynamo's
    guards did). It skips the call path's lookup, counters and timers: the computation function
    itself when the prologue passes dynamo's arguments through in order, the epilogue only
    rebuilds the output tuple and no memory sharing between inputs can matter; the computation
    and the epilogue when the epilogue does more (rebuilds returned views) with nothing from the
    prologue; otherwise the prologue, the alias check where one matters, the computation and
    the epilogue in a row."""
    prologue, computation, epilogue = entry.prologue_fn, entry.computation_fn, entry.epilogue_fn
    # hit_path.alias_check_for makes the same decision: sharing matters only for a program that
    # writes an input (or one compiled for inputs that shared memory).
    sharing_matters = entry.alias_positions is not None and (
        entry.alias_pattern is not None or entry.written_positions != ())
    if sharing_matters:
        alias_check = entry.alias_check

        def checked_call(*args):
            inputs, pro_to_epi = prologue(*args)
            if alias_check(inputs):
                return epilogue(computation(*inputs), pro_to_epi)
            return jitted(*args)  # shared differently: keraunos compiles an entry for it
        return checked_call
    epilogue_trace = entry.epilogue_traces[-1]
    if _passes_arguments_through(entry, n_args):
        if _returns_outputs_as_is(epilogue_trace):
            return computation
        if not _reads_from_prologue(epilogue_trace):
            def computation_epilogue(*args):  # it rebuilds returned views, say
                return epilogue(computation(*args), ())
            return computation_epilogue

    def prologue_computation_epilogue(*args):
        inputs, pro_to_epi = prologue(*args)
        return epilogue(computation(*inputs), pro_to_epi)
    return prologue_computation_epilogue


def _passes_arguments_through(entry: CacheEntry, n_args: int) -> bool:
    """The computation's inputs are dynamo's ``n_args`` arguments, all of them, in order."""
    params = entry.computation_traces[0].params
    return [p.provenance for p in params] == [f"args[{i}]" for i in range(n_args)]


def _reads_from_prologue(epilogue: Trace) -> bool:
    """Whether the epilogue uses anything the prologue hands it (``pro_to_epi``)."""
    return any(b.symbol is glue.UNPACK_OUTPUTS and b.fields.origin == "pro_to_epi" and b.outputs
               for b in epilogue.bound_symbols)


def _returns_outputs_as_is(epilogue: Trace) -> bool:
    """The epilogue unpacks the outputs and returns them in a tuple, in order: nothing else."""
    *unpacks, ret = epilogue.bound_symbols
    if ret.symbol is not glue.RETURN_VALUE or any(b.symbol is not glue.UNPACK_OUTPUTS
                                                  for b in unpacks):
        return False
    outputs = [b.outputs for b in unpacks if b.fields.origin == "outputs"]
    built = ret.args[0] if len(ret.args) == 1 else None
    return (len(outputs) == 1 and not _reads_from_prologue(epilogue)
            and getattr(built, "kind", None) == "tuple"
            and list(built.children) == list(outputs[0]))


_functorch_depth = functorch.depth


def _unwind_functorch(depth: int) -> None:
    """Leave the functorch levels (vmap, grad) entered since the stack was ``depth`` deep, and a
    forward-AD level the graph entered (dynamo's graph of ``torch.func.jvp`` enters one with
    ``_enter_dual_level()``; torch supports one at a time, and the caller had none when the
    Python-level ``forward_ad`` says so)."""
    while _functorch_depth() > depth:
        functorch.leave_innermost()
    if torch.autograd.forward_ad._current_level < 0:
        try:
            autograd_internals.exit_dual_level(level=0)
        except RuntimeError:
            pass  # no level was entered


def _is_dynamic(gm: torch.fx.GraphModule) -> bool:
    """Whether dynamo made any size symbolic: a SymInt input or a tensor of symbolic shape."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(value, torch.Tensor) and any(
                not isinstance(s, int) for s in (*value.shape, *value.stride())):
            return True
    return False


def _graph_break_being_compiled() -> GraphBreak | None:
    """The graph break that made dynamo compile the graph now handed over, if one did.

    Dynamo keeps the reason on its ``OutputGraph`` (``compile_subgraph_reason``), which is on the
    call stack of the backend; there is no public API that gives it to a backend."""
    OutputGraph = dynamo.OutputGraph
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, OutputGraph):
            reason = getattr(owner, "compile_subgraph_reason", None)
            if reason is None or not getattr(reason, "graph_break", False):
                return None
            stack = list(getattr(reason, "user_stack", None) or ())
            if not stack:
                return GraphBreak("<unknown>", 0, str(reason.reason))
            return GraphBreak(stack[-1].filename, stack[-1].lineno, str(reason.reason))
        frame = frame.f_back
    return None


class Backend:
    """A configured keraunos backend for ``torch.compile``; it keeps every subgraph it
    compiled (see ``last_traces`` and ``graph_breaks``).

    >>> import torch, keraunos.dynamo
    >>> be = keraunos.dynamo.backend(executors=["torch"])
    >>> f = torch.compile(lambda x: (x * 2).sin(), backend=be)
    >>> torch.testing.assert_close(f(torch.ones(3)), (torch.ones(3) * 2).sin())
    """

    def __init__(self, executors: Sequence | None = None,
                 transforms: Sequence[Transform] | None = None, fuse: str | None = None):
        self.executors = list(executors) if executors is not None else None
        self.fuse = fuse
        self.transforms = list(transforms or ())
        # Weakly: dynamo holds what it still runs; what dynamo's reset() dropped is freed.
        self._subgraphs: list[weakref.ref] = []
        self._compiled = 0

    @property
    def subgraphs(self) -> list[CompiledSubgraph]:
        """The subgraphs it compiled that dynamo still holds, in the order it compiled them."""
        alive = [s for s in (r() for r in self._subgraphs) if s is not None]
        if len(alive) < len(self._subgraphs):
            self._subgraphs = [weakref.ref(s) for s in alive]
        return alive

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> CompiledSubgraph:
        # example_inputs may be fake tensors and SymInts: keraunos compiles on the first real
        # call instead, from the values dynamo then passes.
        subgraph = CompiledSubgraph(gm, f"subgraph {self._compiled}", self.executors,
                                    self.transforms, _graph_break_being_compiled(), self.fuse)
        self._compiled += 1
        self._subgraphs.append(weakref.ref(subgraph))
        return subgraph


def backend(executors: Sequence | None = None,
            transforms: Sequence[Transform] | None = None, fuse: str | None = None) -> Backend:
    """A ``torch.compile`` backend that runs each subgraph through keraunos with these
    executors, transforms and fuse mode (the same options as ``keraunos.jit``).

    >>> import torch, keraunos.dynamo
    >>> m = torch.compile(torch.nn.Linear(4, 4), backend=keraunos.dynamo.backend())
    >>> out = m(torch.randn(2, 4))
    """
    return Backend(executors, transforms, fuse)


_DEFAULT = Backend()


def backend_entry(gm: torch.fx.GraphModule, example_inputs) -> CompiledSubgraph:
    """``backend="keraunos"``: the default backend, registered through the
    ``torch_dynamo_backends`` entry point."""
    return _DEFAULT(gm, example_inputs)


# ------------------------------------------------------------------------- inspection
def _frames_of(compiled) -> list[tuple]:
    """(code, globals) of the functions dynamo compiles frames of for ``compiled``: the function
    itself; for a module, the function its compiled ``forward`` wraps (its call, with the
    module's forward inlined) and every submodule's ``forward`` (graph breaks inside a submodule
    give it frames of its own)."""
    target = _target_of(compiled)
    functions = [target]
    if isinstance(target, torch.nn.Module):
        functions = [getattr(getattr(compiled, "forward", None), "_torchdynamo_orig_callable",
                             None)]
        functions += [type(m).forward for m in target.modules()]
    # A decorated forward (functools.wraps) runs the function it wraps as a frame of its own
    # when dynamo breaks inside the decorator: transformers 5 decorates every model's forward.
    functions += [f for fn in list(functions) for f in _wrapped_chain(fn)]
    frames = {}
    for fn in functions:
        code, globals_ = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is not None and globals_ is not None:
            frames.setdefault(id(code), (code, globals_))
    return list(frames.values())


def _wrapped_chain(fn) -> list:
    chain = []
    while (fn := getattr(fn, "__wrapped__", None)) is not None and len(chain) < 8:
        chain.append(fn)
    return chain


def subgraphs_of(compiled) -> list[CompiledSubgraph]:
    """The subgraphs dynamo compiled for ``compiled``, found from its cache entries: each
    entry's bytecode names the compiled graphs, the resume functions after graph breaks and the
    global functions it calls, whose own cache entries are searched in turn."""
    if isinstance(compiled, Backend):
        return list(compiled.subgraphs)
    # keraunos.jit(fn, fallback="dynamo") that fell back keeps what it compiled.
    compiled = getattr(getattr(compiled, "_keraunos", None), "dynamo_compiled", compiled)
    cache_entries = dynamo.cache_entries
    found: list[CompiledSubgraph] = []
    seen_codes: set[int] = set()
    pending = _frames_of(compiled)
    while pending:
        code, namespace = pending.pop(0)
        if id(code) in seen_codes:
            continue
        seen_codes.add(id(code))
        for cache_entry in cache_entries(code):
            for name in cache_entry.code.co_names:
                value = _unwrap(namespace.get(name))
                if isinstance(value, CompiledSubgraph) and value not in found:
                    found.append(value)
                elif hasattr(value, "__code__") and hasattr(value, "__globals__"):
                    # A resume function after a graph break, or a helper the frame calls (a
                    # break inside it gives the helper a frame of its own).
                    pending.append((value.__code__, value.__globals__))
    return sorted(found, key=lambda s: s.order)


def _target_of(compiled):
    """The module or function that ``torch.compile`` wrapped."""
    target = getattr(compiled, "_orig_mod", None)  # not `or`: an empty ModuleList is false
    if target is None:
        target = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    return target


def _unwrap(value):
    for _ in range(8):  # dynamo may wrap what the backend returned (disable, wraps)
        if value is None or isinstance(value, CompiledSubgraph):
            return value
        inner = getattr(value, "__wrapped__", None) or getattr(
            value, "_torchdynamo_orig_callable", None)
        if inner is None:
            return value
        value = inner
    return value


def last_traces(compiled) -> list[SubgraphTraces]:
    """Per subgraph that has run, in the order dynamo compiled them: the forward (computation),
    backward and prologue traces of its entry that ran last. ``compiled`` is what
    ``torch.compile(..., backend="keraunos")`` returned, or a ``Backend``."""
    return [t for t in (s.traces() for s in subgraphs_of(compiled)) if t is not None]


def graph_breaks(compiled) -> list[GraphBreak]:
    """The graph breaks dynamo made in ``compiled`` (what was compiled so far), with the user's
    file:line and dynamo's reason."""
    breaks = []
    for s in subgraphs_of(compiled):
        if s.graph_break is not None and s.graph_break not in breaks:
            breaks.append(s.graph_break)
    return breaks
