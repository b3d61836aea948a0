"""The ``inductor`` fusion executor: regions of a trace compiled by TorchInductor.

``keraunos.jit(fn, executors=["inductor", "torch"])``. The executor claims the lines it may fuse
(``regions.fusible``); after the claims, :func:`fuse` turns each maximal run of its lines (cut at
layer boundaries, see ``layers.py``) into one line of the trace that calls the compiled region::

    # inductor_region1: layer h.0, 17 lines, kernel k1 (compiled for this region)
    #   t4 = torch.nn.functional.layer_norm(t3, (64,), weight=ln_1_weight, ...)
    #   ...
    t24, = inductor_region1(t3, ln_1_weight, ln_1_bias, ...)

The region's lines stay in the trace as comments and as the line's ``subsymbols``;
``keraunos.last_fusions(jitted)`` lists every region with its own trace, its FX graph and
Inductor's generated code. Lines of runs too small to be worth a compile, or whose compile
failed, go to the next executor in the list.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core import glue
from ...core.proxies import TensorProxy
from ...core.symbols import BoundSymbol
from ...core.tags import MUTATION
from ...core.trace import Trace
from ..base import Executor, FusionExecutor, give_back
from . import channels_last, compiler, fx_graph, layers, region_call, regions, symbolic, workers
from .regions import Region, find_regions, fusible

__all__ = ["InductorExecutor", "FusionRegion", "fuse", "computes_in_region"]



class InductorExecutor(FusionExecutor):
    """Fuses regions of the forward and backward traces with TorchInductor."""

    name = "inductor"
    compiles_elsewhere = True

    def claims(self, bsym):
        return fusible(bsym)

    def fuse(self, trace, executors, *, observable, always_checked=frozenset(),
             records_autograd=False, forward=None, counter=None, min_shared_layers=2,
             site=None):
        return fuse(trace, executors, observable=observable, always_checked=always_checked,
                    layer_of_name=self._layers_of(forward, min_shared_layers),
                    records_autograd=records_autograd, counter=counter, executor=self,
                    min_shared_layers=min_shared_layers, site=site)

    def prefetch(self, trace, *, observable, always_checked=frozenset(), forward=None,
                 min_shared_layers=2, site=None):
        prefetch(trace, observable=observable, always_checked=always_checked,
                 layer_of_name=self._layers_of(forward, min_shared_layers), executor=self,
                 min_shared_layers=min_shared_layers, site=site)

    def compile_site(self, elsewhere: bool):
        return compiler.CompileSite.in_helpers() if elsewhere else compiler.CompileSite.here()

    def start_helpers(self):
        workers.start()

    @staticmethod
    def _layers_of(forward, min_shared_layers: int):
        """For the backward: its lines' layers are the forward's values' (None: the forward)."""
        if forward is None:
            return None
        return layers.layers_of_names(
            forward, layers.layer_of_lines(forward.bound_symbols, min_repeats=min_shared_layers))

    def computes_in_region(self, bsym):
        return computes_in_region(bsym)



@dataclass
class FusionRegion:
    """One fused region of a compiled entry (``keraunos.last_fusions``)."""

    name: str
    trace_name: str                 # "computation" or "backward"
    layer: str | None
    inputs: list[str]
    outputs: list[str]
    trace: Trace                    # the region's own lines, as a runnable trace
    graph: torch.fx.GraphModule     # what Inductor was given (the same for regions sharing it)
    kernel: compiler.Kernel
    shared_with: str | None = None  # the region the kernel was compiled for, when not this one
    lines: list[BoundSymbol] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # inputs it writes in place (a KV cache)

    def describe_kernel(self) -> str:
        """What runs the region, for the header of its line in the trace."""
        reuse = f"the kernel of {self.shared_with}" if self.shared_with else \
            "compiled for this region"
        return f"kernel k{self.kernel.number} ({reuse})"

    def ready(self) -> None:
        """Return once the region's C++ kernels are built (raises what the build raised)."""
        self.kernel.ready()

    @property
    def kernel_code(self) -> str:
        return self.kernel.code

    @property
    def kernel_path(self) -> str | None:
        return self.kernel.path

    @property
    def source(self) -> str:
        """Everything about the region in one text: its trace, FX graph and generated code."""
        reuse = (f"shares kernel k{self.kernel.number} with {self.shared_with}" if self.shared_with
                 else f"kernel k{self.kernel.number}: {self.kernel.cache} in "
                      f"{self.kernel.seconds:.2f} s")
        return (f"# {self.name} ({self.trace_name}; {reuse})\n{self.trace}\n"
                f"# The FX graph handed to Inductor\n{self.graph.code.strip()}\n\n"
                f"# Inductor's generated code ({self.kernel.path})\n{self.kernel.code}")

    def __repr__(self) -> str:
        return (f"<FusionRegion {self.name}: {len(self.lines)} lines, {len(self.inputs)} inputs, "
                f"{len(self.outputs)} outputs, kernel k{self.kernel.number}>")


FusionSymbol = glue.FusionCall  # one fused region's line (the glue vocabulary's fusion call)


def fuse(trace: Trace, executors: list[Executor], *, observable: set[str],
         always_checked: set[str] = frozenset(), layer_of_name: dict[str, str] | None = None,
         executor: Executor, records_autograd: bool = False,
         counter: list[int] | None = None, min_shared_layers: int = 2,
         site: compiler.CompileSite | None = None) -> tuple[Trace, list[FusionRegion]]:
    """Fuse the runs of lines the fusion executors claimed in ``trace`` (after ``claim``).

    ``observable``: names whose memory sharing the caller can see; ``always_checked``: inputs
    whose strides can change from call to call (the backward's incoming gradients);
    ``records_autograd``: the trace runs with grad mode on and no backward trace of ours, so
    lines reading or making a tensor that requires grad stay with the next executor (autograd
    records the torch ops they run; a compiled region would give outputs without a graph).
    ``site``: where the regions are compiled (``compiler.CompileSite``; None: here, now)."""
    formed = _formed(trace, observable, layer_of_name, executor, records_autograd,
                     min_shared_layers)
    if formed is None:
        return trace, []
    lines, regions, problem = formed
    if problem == "":
        return trace.derive([_given_back(b, executors, executor) for b in lines],
                            "Fusion: no regions"), []
    always_checked = _varying_with(always_checked, lines, regions)
    counter = counter if counter is not None else [0]
    if site is None and regions:
        site = compiler.CompileSite.here()
    environment = site.environment if regions else ()
    done: dict[int, str] = {}  # kernel number -> the first region of this trace using it
    fused: dict[int, tuple[BoundSymbol, Region]] = {}
    with _autocast_off():  # a region's graph is its lines as written (their casts included)
        prepared = [_prepare(r, environment, always_checked) for r in regions]
        _prefetch(regions, prepared, site, skip_first=not site.elsewhere if regions else True)
        for r, p in zip(regions, prepared):
            made = _fuse_region(r, p, trace.name, counter, always_checked, done, site) \
                if p else None
            if made is not None:
                fused[r.start] = (made, r)
    result = _assemble(lines, fused, executors, executor)
    kept = [b.symbol.region for b in result if isinstance(b.symbol, FusionSymbol)]
    names = ", ".join(dict.fromkeys(b.executor for b in result))
    label = f"{len(kept)} regions" if problem is None else f"no regions, {problem}"
    return trace.derive(result, f"Fusion [{names}]: {label}"), kept


def _formed(trace, observable, layer_of_name, executor, records_autograd,
            min_shared_layers: int = 2):
    """The trace's lines and its regions, with why there are none (None when the executor claimed
    no line; a problem of "" when every claimed line reads or makes a tensor autograd records)."""
    lines = list(trace.bound_symbols)
    claimed = [b.executor == executor.name for b in lines]
    if not any(claimed):
        return None
    if records_autograd or _switches_grad_mode(lines):  # lines may record autograd as they run
        recording = _recording_autograd(lines, records_autograd)
        claimed = [c and not (r and any(getattr(p, "requires_grad", False)
                                        for p in b.input_proxies() + b.output_proxies()))
                   for b, c, r in zip(lines, claimed, recording)]
    if not any(claimed):
        return lines, [], ""
    regions = []
    problem = _why_not(lines, claimed)
    if problem is None:
        tags = layers.layer_of_lines(lines, layer_of_name, min_repeats=min_shared_layers)
        lines, regions = find_regions(lines, claimed, tags, observable)
    return lines, regions, problem


def prefetch(trace: Trace, *, observable: set[str], always_checked: set[str] = frozenset(),
             layer_of_name: dict[str, str] | None = None, executor: Executor,
             min_shared_layers: int = 2, site: compiler.CompileSite | None = None) -> None:
    """Hand the distinct regions ``fuse`` will compile for ``trace`` to the helper processes
    now, while this thread compiles another trace's first (the backward's, during the forward's:
    ``pipeline.fuse_regions``). The regions are formed again by ``fuse``, as they were here."""
    elsewhere = site is not None and site.elsewhere
    if not elsewhere and not workers.available():
        return
    formed = _formed(trace, observable, layer_of_name, executor, records_autograd=False,
                     min_shared_layers=min_shared_layers)
    if formed is None or formed[2] is not None or not formed[1]:
        return
    lines, regions_ = formed[0], formed[1]
    always_checked = _varying_with(always_checked, lines, regions_)
    site = site or compiler.CompileSite.here()
    with _autocast_off():
        _prefetch(regions_, [_prepare(r, site.environment, always_checked) for r in regions_],
                  site, skip_first=False)


class _autocast_off:
    """Autocast off on this thread (the user's, under ``fuse="wait"``), then as it was."""

    def __enter__(self):
        self.was = [(d, torch.is_autocast_enabled(d)) for d in glue.AUTOCAST_DEVICES]
        for device, _ in self.was:
            torch.set_autocast_enabled(device, False)

    def __exit__(self, *exc):
        for device, enabled in self.was:
            torch.set_autocast_enabled(device, enabled)


def _varying_with(always_checked, lines, regions) -> set[str]:
    """The names whose layout can change from call to call: ``always_checked`` (the backward's
    incoming gradients), and what lines outside regions make from them (``view(grad0, ...)``:
    a gradient's strides carry over). A region's outputs have the layouts its kernel gives,
    whatever its inputs' were. Regions check these inputs on every call; Inductor's code checks
    none (``compiler.CONFIG_PATCHES``)."""
    varying = set(always_checked)
    if not varying:
        return varying
    inside = {i for r in regions for i in range(r.start, r.stop)}
    for i, b in enumerate(lines):
        if i not in inside and any(p.name in varying for p in b.input_proxies()):
            varying.update(p.name for p in b.output_proxies())
    return varying


def _assemble(lines, fused, executors, executor) -> list[BoundSymbol]:
    """The trace's lines with each fused region's run replaced by its one line."""
    result = []
    i = 0
    while i < len(lines):
        if i in fused:
            bsym, region = fused[i]
            result.append(bsym)
            i = region.stop
            continue
        result.append(_given_back(lines[i], executors, executor))
        i += 1
    return result


def _given_back(bsym, executors, executor):
    """A line this executor claimed but no region took, for the next executor that claims it."""
    return give_back(bsym, executors) if bsym.executor == executor.name else bsym


def _why_not(lines, claimed) -> str | None:
    # Under autocast, and where the program switches it: capture wrote autocast's casts as
    # lines (a line whose casts it could not write is tagged UNDER_AUTOCAST and stays outside
    # regions, ``regions.fusible``), so a region computes the same whatever autocast is where it
    # runs. Its kernels call no op that autocast changes: Inductor's extern calls are ``out=``
    # variants and lowered ATen ops (``convolution``, ``_cdist_forward``), not autocast's.
    devices = {(b.output_proxies() or b.input_proxies())[0].device.type
               for b, c in zip(lines, claimed) if c}  # (a claimed write may bind no output)
    for device in sorted(devices):
        problem = compiler.toolchain_problem(device)
        if problem is not None:
            compiler.warn_once(f"keraunos: the inductor executor cannot build {device} kernels "
                               f"here ({problem}); the torch executor runs its ops instead.")
            return problem
    return None


def _recording_autograd(lines, records_autograd: bool) -> list[bool]:
    """For each line, whether grad mode is on where it runs in a trace that autograd records
    (``records_autograd``: the trace starts under grad mode with no backward trace of ours); a
    ``torch.enable_grad()`` inside counts as recording anywhere. An optimizer's step switches
    grad mode off first: its writes to parameters record nothing, and may fuse."""
    recording, now = [], records_autograd
    for b in lines:
        if b.symbol is glue.SET_GLOBAL_STATE:
            now = dict(b.args[0]).get(0, now)  # index 0: grad mode (capture/ambient.py)
        recording.append(now)
    return recording


def _switches_grad_mode(lines) -> bool:
    """A ``with torch.no_grad()`` or ``enable_grad()`` inside a program without a backward trace
    of ours: the lines under grad mode that read or make tensors requiring grad stay out of
    regions (autograd records them), the others may fuse; a switch is a line no region crosses."""
    return any(b.symbol is glue.SET_GLOBAL_STATE for b in lines)


@dataclass
class _Prepared:
    """A region's FX graph and key, made before any region of the trace is compiled."""

    layout: symbolic.Layout
    graph: object
    channels_last_choice: bool | None
    key: tuple


def _prepare(r: Region, environment, always_checked) -> _Prepared | None:
    """None for a region that is not compiled: one writing an incoming gradient in place (a call
    that relaid the gradient, of any strides, would write the copy)."""
    checked = {k for k, p in enumerate(r.inputs) if p.name in always_checked}
    if set(r.written_inputs) & checked:
        return None
    layout = symbolic.Layout(r.inputs)  # sizes read from the inputs: one for every use below
    graph = fx_graph.region_graph(r.lines, r.inputs, r.outputs, layout)
    choice = channels_last.layout_optimization(r.lines)
    return _Prepared(layout, graph, choice,
                     fx_graph.region_key(graph, r.inputs,
                                         environment + (("layout_optimization", choice),)))


def _prefetch(regions_, prepared, site, skip_first: bool) -> None:
    """Hand the trace's distinct regions (but the first, which this thread compiles at once,
    when ``skip_first``) to the helper processes (``workers``): they fill Inductor's caches
    meanwhile; this thread takes back any that no helper has started by the time it gets there.
    With a ``site`` that compiles ``elsewhere``, every region goes to them, at once."""
    if not regions_ or (not site.elsewhere and not workers.available()):
        return
    keys = list(dict.fromkeys(p.key for p in prepared if p is not None))
    for key in keys[1 if skip_first else 0:]:
        r, p = next((r, p) for r, p in zip(regions_, prepared) if p is not None and p.key == key)
        compiler.prefetch(key, p.graph, r.inputs, p.channels_last_choice, site)


def _fuse_region(r: Region, prepared: _Prepared, trace_name, counter, always_checked, done,
                 site):
    checked = tuple(k for k, p in enumerate(r.inputs) if p.name in always_checked)
    writes_memory = any(regions.writes(b) is not None for b in r.lines)
    written = tuple(r.written_inputs)
    name = f"inductor_region{counter[0]}"
    layout, graph, key = prepared.layout, prepared.graph, prepared.key
    channels_last_choice = prepared.channels_last_choice
    kernel, existed = compiler.kernel_for(
        key, lambda: fx_graph.graph_module(fx_graph.region_graph(r.lines, r.inputs,
                                                                 r.outputs, layout)),
        r.inputs, r.outputs, name, layout, graph, channels_last_choice, site)
    if isinstance(kernel, compiler.CompileFailure) and isinstance(
            kernel.error, compiler.NotCompiledElsewhere):
        if str(kernel.error) not in site.refusals:
            site.refusals.append(str(kernel.error))
        if not kernel.error.expected:
            compiler.warn_once(f"keraunos: a region was not fused in the background "
                               f"({kernel.error}); its lines run on the next executor.")
        return None
    if isinstance(kernel, compiler.CompileFailure):
        compiler.warn_once(f"keraunos: Inductor could not compile a region of {trace_name} "
                           f"({type(kernel.error).__name__}: {kernel.error}); its "
                           f"{len(r.lines)} lines run on the next executor.")
        return None
    region_trace = Trace(name, list(r.inputs), list(r.lines) + [
        glue.RETURN_REGION.bind(*r.outputs)])
    try:  # with symbolic sizes, a call the kernel's guards reject runs the region's own lines
        call = region_call.RegionCall(kernel, r.inputs, r.outputs, checked, fallback=(
            region_trace.python_callable() if kernel.guards else None),
            make_fallback=region_trace.python_callable, layout=layout, written=written,
            writes=writes_memory)
    except compiler.SymbolicUnguardable as e:
        compiler.warn_once(f"keraunos: a region of {trace_name} was compiled assuming "
                           f"{', '.join(map(str, e.args[0]))}, which it cannot check; its "
                           f"{len(r.lines)} lines run on the next executor.")
        return None
    counter[0] += 1
    shared = done.get(kernel.number) or ("a region compiled earlier" if existed else None)
    done.setdefault(kernel.number, name)
    region = FusionRegion(name, trace_name, r.layer, [p.name for p in r.inputs],
                          [p.name for p in r.outputs], region_trace, kernel.graph, kernel, shared,
                          list(r.lines), [r.inputs[k].name for k in written])
    return BoundSymbol(FusionSymbol(region, call), tuple(r.inputs), outputs=tuple(r.outputs),
                       subsymbols=list(r.lines), executor=InductorExecutor.name,
                       tags={MUTATION} if writes_memory else set())


# Ops Inductor hands to the library calls eager makes too (BLAS, oneDNN): no win from a region.
_EXTERN_NAMES = ("mm", "bmm", "addmm", "matmul", "linear", "conv1d", "conv2d", "conv3d",
                 "convolution", "baddbmm", "addmv", "mv", "dot", "einsum",
                 "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu")


def _extern_ops() -> dict[int, object]:
    """The ops of those names, by id (the values keep them alive): torch's functions and the
    tensor methods, with their private (``torch`` namespace's ``_convolution``) and in-place (``addmm_``) forms
    and ``x @ w``; the ATen ops, with the overloads of each (``aten.mm.default``)."""
    aten = torch.ops.aten
    forms = [form for name in _EXTERN_NAMES for form in (name, "_" + name, name + "_")]
    found = [getattr(namespace, form) for form in forms
             for namespace in (torch, torch.nn.functional, torch.linalg, torch.Tensor, aten)
             if hasattr(namespace, form)]
    found.append(torch.Tensor.__matmul__)
    found += [getattr(packet, o) for packet in (getattr(aten, n) for n in _EXTERN_NAMES
                                                if hasattr(aten, n)) for o in packet.overloads()]
    return {id(f): f for f in found}


_EXTERN = _extern_ops()


def computes_in_region(bsym: BoundSymbol) -> bool:
    """A line a region would compute itself (``tiers.worth_fusing`` counts these): one the
    fusion executor may claim, whose outputs are new memory (not views), and that is not a
    matrix product or convolution."""
    if not fusible(bsym) or id(bsym.symbol.fn) in _EXTERN:
        return False
    read = {p.storage for p in bsym.input_proxies() if isinstance(p, TensorProxy)}
    return any(p.storage is None or p.storage not in read for p in bsym.output_proxies()
               if isinstance(p, TensorProxy))
