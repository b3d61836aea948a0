"""A region as an FX graph, with names that depend only on its structure, and its cache key.

The graph is built straight from the region's lines (no Dynamo): a placeholder ``i0, i1, ...``
per input in order of first use, one node per line calling the same torch callable the trace
calls, and an output tuple. FX names the other nodes after their targets (``linear``,
``linear_1``), so two regions made of the same ops in the same order print the same code, which
is what Inductor's own caches and keraunos's key compare.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ...core.proxies import Proxy, TensorProxy
from ...core.symbols import BoundSymbol


def region_graph(lines: list[BoundSymbol], inputs: list[TensorProxy],
                 outputs: list[TensorProxy]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {p.name: graph.placeholder(f"i{k}") for k, p in enumerate(inputs)}
    for b in lines:
        args, kwargs = pytree.tree_map(lambda x: env[x.name] if isinstance(x, Proxy) else x,
                                       (b.args, b.kwargs))
        _bind(graph, b.outputs, _node(graph, b.symbol, tuple(args), dict(kwargs)), env)
    graph.output(tuple(env[p.name] for p in outputs))
    return graph


def graph_module(graph: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(torch.nn.Module(), graph)


def _node(graph: fx.Graph, symbol, args: tuple, kwargs: dict) -> fx.Node:
    if symbol.style == "function":
        return graph.call_function(symbol.fn, args, kwargs)
    if symbol.style == "getitem":
        return graph.call_function(operator.getitem, args, kwargs)
    # Methods and operators (``x.view(...)``, ``x.__radd__(2)``) as method calls, which
    # Inductor's caches accept for tensors.
    return graph.call_method(symbol.name, args, kwargs)


def _bind(graph: fx.Graph, outputs, node: fx.Node, env: dict[str, fx.Node]) -> None:
    """Name ``outputs`` (a proxy, or nested tuples of them) by ``node`` and its items."""
    if isinstance(outputs, Proxy):
        env[outputs.name] = node
        return
    for k, item in enumerate(outputs):
        if item is not None:
            _bind(graph, item, graph.call_function(operator.getitem, (node, k)), env)


def fake_inputs(inputs: list[TensorProxy], fake_mode) -> list[torch.Tensor]:
    """Fake tensors of the recorded metadata (strides included: the compiled code asserts them)."""
    with fake_mode:
        return [torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
                for p in inputs]


def propagate(gm: fx.GraphModule, fakes: list[torch.Tensor], fake_mode,
              outputs: list[TensorProxy]) -> None:
    """Run the graph on the fakes: each node's ``example_value`` (Inductor's caches want one for
    every tensor a method is called on), and a check that the graph makes what the trace says."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    with torch.no_grad():
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    made = next(n for n in gm.graph.nodes if n.op == "output").meta["val"]
    for p, t in zip(outputs, made):
        if (tuple(t.shape), t.dtype) != (p.shape, p.dtype):
            raise AssertionError(f"the region's graph makes {p.name} as {tuple(t.shape)} "
                                 f"{t.dtype}, the trace says {p.shape} {p.dtype}")


def alias_pattern(inputs: list[TensorProxy]) -> tuple:
    """Which inputs share memory: for each input, the position of the first input sharing it."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(p.storage, k) if p.storage is not None else k
                 for k, p in enumerate(inputs))


def region_key(graph: fx.Graph, inputs: list[TensorProxy], environment: tuple) -> tuple:
    """What decides the compiled code: the ops and constants (the graph's code, free of trace
    names), each input's metadata, which inputs share memory, and the compile environment."""
    metas = tuple((p.shape, p.stride, p.dtype, p.device) for p in inputs)
    return (graph.python_code(root_module="self").src, metas, alias_pattern(inputs), environment)
