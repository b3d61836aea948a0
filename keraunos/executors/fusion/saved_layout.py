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


def candidates(forward: Trace, backward: Trace | None, backward_regions) -> set[str]:
    """The names of the forward's saved tensors that a forward region may hand out in any
    layout (see the module docstring; what the forward itself reads is checked per region)."""
    if backward is None or not backward_regions:
        return set()
    last = forward.bound_symbols[-1]
    if last.symbol is not glue.RETURN_FORWARD:
        return set()
    returned = {p.name for p in last.args[0] if isinstance(p, TensorProxy)}
    saved = {p.name: p for p in last.args[1]
             if isinstance(p, TensorProxy) and p.name not in returned and _plain_4d(p)}
    if not saved:
        return set()
    inside = {id(b) for r in backward_regions for b in r.lines}
    for b in backward.bound_symbols:
        read = [p for p in b.input_proxies() if p.name in saved]
        if not read:
            continue
        if id(b) not in inside:
            for p in read:
                saved.pop(p.name, None)
            continue
        made = {q.storage for q in b.output_proxies() if isinstance(q, TensorProxy)}
        for p in read:
            if p.storage is not None and p.storage in made:  # a view of it
                saved.pop(p.name, None)
    for r in backward_regions:
        read = [k for k, p in enumerate(r.inputs) if p.name in saved]
        if read and not _runs_channels_last(r, read):
            for k in read:
                saved.pop(r.inputs[k].name, None)
    return set(saved)


def free_outputs(region, candidate_names: set[str], lines) -> tuple[int, ...]:
    """Positions of ``region``'s outputs that are free: candidates that no line of the trace
    after the region reads (the forward's return aside)."""
    if not candidate_names:
        return ()
    wanted = {p.name for p in region.outputs} & candidate_names
    for b in lines[region.stop:]:
        if b.symbol is glue.RETURN_FORWARD:
            continue
        wanted -= {p.name for p in b.input_proxies()}
    return tuple(k for k, p in enumerate(region.outputs) if p.name in wanted)


def adopt_strides(outputs: list[TensorProxy], free: tuple[int, ...], strides) -> None:
    """Give the free outputs' proxies the strides the compiled graph gives them (``strides``:
    one tuple of ints per output, None where not known)."""
    if strides is None:
        return
    for k in free:
        given = strides[k] if k < len(strides) else None
        p = outputs[k]
        if given is not None and len(given) == len(p.shape):
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
    return tuple(p.stride) == _contiguous(p.shape)


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
