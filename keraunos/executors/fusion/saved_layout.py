"""Saved tensors in the layout Inductor chose: layout propagation from the forward to the backward.

Inductor lays out a CPU graph that holds a convolution channels-last (``channels_last.py``), and
keeps eager's strides only at the graph's outputs: every output of a region is copied back to
eager's layout. For a training step that copy is waste where the output is a tensor the forward
saves for the backward and nothing else reads: the backward's regions read it, and their
convolution backward runs faster channels-last (the 1x1 convolutions' ``_slow_conv2d_backward``
about 2x on efficientnet_b0, docs/benchmarks.md), so they would convert it again. A whole-model
``torch.compile`` graph never makes the copies: AOTAutograd tells Inductor which outputs the user
sees, and the saved ones keep Inductor's layout into the backward graph.

Here a forward region's output is *free* (Inductor may choose its layout) when:

- the forward saves it for the backward, does not return it to the user, and no forward line
  after the region reads it;
- it is a dense 4-D floating tensor of static sizes;
- every backward line that reads it lies in one of the backward's regions (formed here as the
  backward's ``fuse`` will form them), none of them is a view of it, and each such region's
  graph runs on fake inputs with it channels-last. The last check is what makes the change safe
  should a backward region run its own lines after all (a failed compile): fake tensors follow
  eager's stride rules, so the lines that ran on the fakes run on the real tensor too.

The region is compiled with its free outputs left out of Inductor's user-visible outputs
(``inner_compile`` below); the strides its compiled graph gives them (``output_strides``) become
the strides of their proxies, which the forward and the backward trace share, so the backward's
regions are compiled for them and the forward's region call copies nothing. Gradients, user
outputs and everything the user sees keep eager's strides. A kernel whose output strides are not
known (one loaded from keraunos's store) leaves the proxies as they were; the region call then
lays its outputs out as recorded, as it does for any output whose strides differ.
"""
from __future__ import annotations

import torch

from ...core import glue
from ...core.proxies import TensorProxy
from ...core.trace import Trace

_FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
WITHIN_TRACE = True
_LAYOUT_BLIND = (glue.DELETE, glue.SIZE, glue.RETURN_FORWARD)  # lines that read no elements


def candidates(forward: Trace, backward: Trace | None, backward_regions) -> set[str]:
    """The names of the forward's saved tensors that the backward may read in any layout (see
    the module docstring; what the forward itself reads is checked by ``free_names``)."""
    if backward is None or not backward_regions:
        return set()
    last = forward.bound_symbols[-1]
    if last.symbol is not glue.RETURN_FORWARD:
        return set()
    returned = {p.name for p in last.args[0] if isinstance(p, TensorProxy)}
    saved = {p.name for p in last.args[1]
             if isinstance(p, TensorProxy) and p.name not in returned and _plain_4d(p)}
    return _read_only_in_regions(saved, backward.bound_symbols, backward_regions)


def free_names(lines, regions, observable: set[str], saved_ok: set[str]) -> set[str]:
    """The outputs of ``regions`` (of a trace's ``lines``) that may leave their region in the
    layout Inductor chose: not ``observable`` (the trace's returned values), read only by lines
    of later regions, and, where the forward saves them for the backward, in ``saved_ok``
    (``candidates``)."""
    made = {p.name for r in regions for p in r.outputs
            if isinstance(p, TensorProxy) and p.name not in observable and _plain_4d(p)}
    for b in lines:
        if b.symbol is glue.RETURN_FORWARD:
            made -= {p.name for p in b.args[1] if isinstance(p, TensorProxy)} - set(saved_ok)
    if not WITHIN_TRACE:  # (experiment) only what no later line of the trace reads
        for b in lines:
            if b.symbol not in _LAYOUT_BLIND:
                made -= {p.name for p in b.input_proxies()} - {q.name for r in regions
                                                               for q in r.outputs
                                                               if any(b is x for x in r.lines)}
        if not saved_ok:
            return set()
    return _read_only_in_regions(made, lines, regions)


def _read_only_in_regions(names: set[str], lines, regions) -> set[str]:
    """Those of ``names`` that every line reading them reads inside a region (the return of a
    forward, ``del`` and ``Size`` lines aside), in none of them through a view, and whose
    reading regions' graphs run with them channels-last (on fake tensors)."""
    names = set(names)
    inside = {id(b) for r in regions for b in r.lines}
    for b in lines:
        if b.symbol in _LAYOUT_BLIND:
            continue
        read = [p for p in b.input_proxies() if p.name in names]
        if not read:
            continue
        if id(b) not in inside:
            names -= {p.name for p in read}
            continue
        views = {q.storage for q in b.output_proxies() if isinstance(q, TensorProxy)}
        names -= {p.name for p in read if p.storage is not None and p.storage in views}
    for r in regions:
        read = [k for k, p in enumerate(r.inputs) if p.name in names]
        if read and not _runs_channels_last(r, read):
            names -= {r.inputs[k].name for k in read}
    return names


def free_outputs(region, names: set[str]) -> tuple[int, ...]:
    """Positions of ``region``'s outputs among ``names`` (``free_names``)."""
    return tuple(k for k, p in enumerate(region.outputs) if p.name in names)


def adopt_strides(outputs: list[TensorProxy], free: tuple[int, ...], strides) -> None:
    """Give the free outputs' proxies the strides the compiled graph gives them (``strides``:
    one tuple of ints per output, None where not known)."""
    if strides is None:
        return
    for k in free:
        given = strides[k] if k < len(strides) else None
        p = outputs[k]
        # Only channels-last: the lines reading it were run on fakes of that layout (any other
        # stays as recorded, and the region call lays it out so).
        if given is not None and tuple(given) == _channels_last(p.shape):
            p.stride = tuple(given)


def output_strides(compiled) -> list | None:
    """The strides Inductor's compiled graph gives its outputs, as ints (None where one is not
    a plain number, or the graph is not found)."""
    from torch._inductor.output_code import CompiledFxGraph

    from .compiler import _find_in_closures
    graph = compiled if isinstance(compiled, CompiledFxGraph) else \
        _find_in_closures(compiled, CompiledFxGraph)
    found = getattr(graph, "output_strides", None)
    if found is None:
        return None
    result = []
    for stride in found:
        try:
            result.append(None if stride is None else tuple(int(str(s)) for s in stride))
        except ValueError:
            result.append(None)
    return result


def inner_compile(free: tuple[int, ...]):
    """Inductor's ``compile_fx_inner`` with every output but the ``free`` ones user-visible
    (their strides kept). Used with ``keep_output_stride`` off (``CONFIG_PATCHES``), which makes
    no output user-visible and sets the graph apart in Inductor's caches: their keys hold the
    config, not the graph's output metadata."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import output_node

    def compile_inner(gm, example_inputs, **kwargs):
        node = output_node(gm)
        outputs = torch.utils._pytree.arg_tree_leaves(*node.args)
        node.meta["user_visible_output_idxs"] = [
            i for i, n in enumerate(outputs) if isinstance(n, torch.fx.Node) and i not in free]
        return compile_fx_inner(gm, example_inputs, **kwargs)
    return compile_inner


def _plain_4d(p: TensorProxy) -> bool:
    if len(p.shape) != 4 or p.dtype not in _FLOATING or p.device.type != "cpu":
        return False
    if not all(type(v) is int for v in (*p.shape, *p.stride)):
        return False
    # (channels-last too: a program loaded from the store has the strides an earlier
    # compile adopted, and must make the same choices again)
    return tuple(p.stride) in (_contiguous(p.shape), _channels_last(p.shape))


def _contiguous(shape) -> tuple[int, ...]:
    stride, result = 1, []
    for n in reversed(shape):
        result.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(result))


def _channels_last(shape) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _runs_channels_last(region, positions: list[int]) -> bool:
    """Whether the backward region's graph runs on fake inputs with those inputs
    channels-last."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import fx_graph, symbolic
    try:
        layout = symbolic.Layout(region.inputs)
        if layout.extra or not all(isinstance(p, TensorProxy) for p in region.inputs):
            return False
        gm = fx_graph.graph_module(fx_graph.region_graph(region.lines, region.inputs,
                                                         region.outputs, layout))
        mode = FakeTensorMode()
        with mode:
            fakes = [torch.empty_strided(p.shape, _channels_last(p.shape) if k in positions
                                         else p.stride, dtype=p.dtype, device=p.device)
                     for k, p in enumerate(region.inputs)]
        fx_graph.example_values(gm, fakes, mode)
    except Exception:  # noqa: BLE001 - any failure: keep eager's layout
        return False
    return True


def channels_last_outputs(graph, free: tuple[int, ...]):
    """``graph`` with its outputs at ``free`` made channels-last (a clone Inductor writes in
    the producing kernel)."""
    if not free:
        return graph
    out = next(n for n in graph.nodes if n.op == "output")
    values = list(out.args[0])
    with graph.inserting_before(out):
        for k in free:
            values[k] = graph.call_function(torch.ops.aten.clone.default, (values[k],),
                                            {"memory_format": torch.channels_last})
    out.args = (tuple(values),)
    return graph


def adopt_channels_last(outputs, free) -> None:
    for k in free:
        outputs[k].stride = _channels_last(outputs[k].shape)
