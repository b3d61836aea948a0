"""A region as an FX graph, with names that depend only on its structure, and its cache key.

The graph is built straight from the region's lines (no Dynamo), by walking them as any trace is
walked (``core.interpreter.Interpreter``, with FX nodes as the values): a placeholder ``i0, i1,
...`` per input in order of first use, one node per line calling the same torch callable the
trace calls, and an output tuple. FX names the other nodes after their targets (``linear``,
``linear_1``), so two regions made of the same ops in the same order print the same code, which
is what Inductor's own caches and keraunos's key compare.

Three kinds of line are rewritten on the way: a ``cat`` of one non-empty tensor that the region
returns becomes a ``clone`` in the memory format the trace records (``_cat_of_one``), so that
Inductor lays it out as eager does; the convolutions that run faster channels-last run on
channels-last copies made in the graph (``channels_last.relaid_line``); and float32 column
sums and BatchNorm's training statistics accumulate in float64, as eager's CPU kernels do
(``accumulation``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...core.symbolic import SymbolicValue
from ...core.interpreter import Interpreter
from ...core.proxies import NumberProxy, Proxy, TensorProxy
from ...core.symbols import BoundSymbol
from . import accumulation, channels_last, float_symbols, symbolic


def region_graph(lines: list[BoundSymbol], inputs: list[TensorProxy],
                 outputs: list[TensorProxy], layout: symbolic.Layout | None = None) -> fx.Graph:
    """Inputs are tensors and, in a region with symbolic sizes, the size symbols it reads
    (``layout``: the inputs' ``symbolic.Layout``, when the caller has it)."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {p.name: graph.placeholder(f"i{k}") for k, p in enumerate(inputs)}
    symbols = {p.symbol: env[p.name] for p in inputs if isinstance(p, NumberProxy)}
    layout = layout or symbolic.Layout(inputs)
    for k, (_, _, symbol) in enumerate(layout.extra, start=len(inputs)):
        symbols[symbol] = graph.placeholder(f"i{k}")  # a size read from a tensor, by the caller
    floats = {env[p.name] for p in inputs if float_symbols.is_float_symbol(p)}
    _GraphBuilder(graph, env, symbols, {p.name for p in outputs}, floats).run(lines)
    graph.output(tuple(env[p.name] for p in outputs))
    return graph


class _GraphBuilder(Interpreter):
    """Walks a region's lines with FX nodes as the values: each line becomes the node calling its
    torch callable, each output the node (or a ``getitem`` of it) that makes it."""

    def __init__(self, graph: fx.Graph, env: dict[str, fx.Node], symbols: dict,
                 leaving: set[str], floats: set[fx.Node] = frozenset()):
        super().__init__(env)
        self.graph = graph
        self.symbols = symbols  # size symbol -> the node giving it
        self.leaving = leaving  # the names the region returns
        self.floats = set(floats)  # nodes of float values: float symbols' stand-ins, expressions

    def constant(self, x):
        if float_symbols.is_float_argument(x):  # ``1.0 + (-0.01)*s0``: on s0's stand-in
            node = float_symbols.expression_node(self.graph, x, self.env)
            self.floats.add(node)
            return node
        if isinstance(x, SymbolicValue):  # ``2*s0``: computed in the graph from s0
            node, symbols = x.value.node, self.symbols
            if node.shape_env is not None:
                # An input's symbol may have been found equal to another since (HF generate's
                # cache_position and input_ids lengths: s98 -> s27): expressions use the one
                # the ShapeEnv keeps, and the input gives its value too.
                replace = node.shape_env.replace
                symbols = {**{replace(s): n for s, n in symbols.items()}, **symbols}
            return symbolic.expression_node(self.graph, node.expr, symbols)
        return x

    def run_line(self, index, bsym, args, kwargs):
        alone = _cat_of_one(bsym, self.leaving)
        if alone is not None:  # a copy in the layout the trace says, not Inductor's ``clone``
            k, memory_format = alone
            return self.graph.call_function(torch.ops.aten.clone.default, (args[0][k],),
                                            {"memory_format": memory_format})
        relaid = channels_last.relaid_line(self.graph, bsym, tuple(args), dict(kwargs))
        if relaid is not None:  # a convolution run on channels-last copies
            return relaid
        floats = [isinstance(a, fx.Node) and a in self.floats for a in args]
        alpha = kwargs.get("alpha")
        scaled = isinstance(alpha, fx.Node) and alpha in self.floats
        if any(floats) or scaled:  # as eager converts a Python scalar to the op's type
            dtype = (bsym.output_proxies() or bsym.args)[0].dtype
            args = [float_symbols.as_operand(self.graph, a, dtype) if f else a
                    for a, f in zip(args, floats)]
            if scaled:
                args, kwargs = float_symbols.scaled_by_alpha(self.graph, args, kwargs, dtype)
        for accurate in (accumulation.summed_line, accumulation.batch_norm_line):
            node = accurate(self.graph, bsym, tuple(args))
            if node is not None:  # a reduction accumulated as eager's kernel does
                return node
        return _node(self.graph, bsym.symbol, tuple(args), dict(kwargs))

    def bind(self, proxies, node) -> None:
        """Name ``proxies`` (a proxy, or nested tuples of them) by ``node`` and its items (a
        tuple of nodes: one per proxy)."""
        if isinstance(proxies, Proxy):
            self.bind_name(proxies.name, node)
            return
        if isinstance(node, tuple):
            for item, value in zip(proxies, node):
                if item is not None:
                    self.bind(item, value)
            return
        for k, item in enumerate(proxies):
            if item is not None:
                self.bind(item, self.graph.call_function(operator.getitem, (node, k)))


_CATS = (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default)


def _cat_of_one(bsym: BoundSymbol, leaving: set[str]) -> tuple[int, torch.memory_format] | None:
    """For a ``cat`` whose tensors are all empty but one (litgpt's rotary embedding joins the
    rotated part of each head with an empty rest, ``torch.cat((roped, x[..., 64:]), -1)``):
    that tensor's position and the memory format of the output the trace records. Inductor's
    decomposition drops the empty tensors and clones the one left *in its own layout*, where
    eager's ``cat`` (and so the trace) makes a contiguous tensor; the region then hands back
    the query and key, and the attention output made from them, in another layout than the
    trace says, and each call copied all three back (litgpt's training step: three copies of
    every layer's forward, and a clone of the attention output's reshape, which came back as
    a view of it). A ``clone`` in the recorded format keeps Inductor's layout equal to the
    trace's. Only a ``cat`` whose value the region returns (in ``leaving``): one used inside
    alone is laid out as Inductor finds best, as before (litgpt's forward under ``no_grad``).
    None for any other line (sizes that are symbolic, a format that is neither contiguous nor
    channels-last, or an empty tensor of another dtype: ``cat`` promotes)."""
    if getattr(bsym.symbol, "fn", None) not in _CATS or not bsym.args:
        return None
    tensors, out = bsym.args[0], bsym.output_proxies()
    if not isinstance(tensors, (tuple, list)) or len(out) != 1 or out[0].name not in leaving or \
            not all(isinstance(t, TensorProxy) for t in (*tensors, out[0])):
        return None
    if any(not isinstance(n, int) for t in (*tensors, out[0]) for n in (*t.shape, *t.stride)):
        return None
    full = [k for k, t in enumerate(tensors) if 0 not in t.shape]
    if len(full) != 1 or any(t.dtype != out[0].dtype for t in tensors):
        return None
    made = torch.empty_strided(out[0].shape, out[0].stride, device="meta")
    for memory_format in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        try:
            if made.is_contiguous(memory_format=memory_format):
                return full[0], memory_format
        except RuntimeError:  # channels-last of a tensor that is not 4-D (5-D)
            continue
    return None


def graph_module(graph: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(torch.nn.Module(), graph)


def _node(graph: fx.Graph, symbol, args: tuple, kwargs: dict) -> fx.Node:
    if symbol.style == "function":
        return graph.call_function(symbol.fn, args, kwargs)
    if symbol.style == "getitem":
        return graph.call_function(operator.getitem, args, kwargs)
    if symbol.style == "getter":  # ``w.T``
        return graph.call_function(getattr, (args[0], symbol.name))
    # Methods and operators (``x.view(...)``, ``x.__radd__(2)``) as method calls, which
    # Inductor's caches accept for tensors.
    return graph.call_method(symbol.name, args, kwargs)


def fake_inputs(inputs: list[TensorProxy], fake_mode,
                layout: symbolic.Layout | None = None) -> list:
    """Fake tensors of the recorded metadata (strides included: the compiled code asserts them);
    a size symbol's example is its capture-time ``SymInt``, moved to the ``ShapeEnv`` of
    ``fake_mode`` (the region's private copy of the capture's)."""
    env = fake_mode.shape_env

    def sizes(values):
        return [symbolic.moved(v, env) for v in values]
    with fake_mode:
        fakes = [torch.empty((), dtype=torch.float64) if float_symbols.is_float_symbol(p) else
                 sizes([p.value])[0] if isinstance(p, NumberProxy) else
                 torch.empty_strided(sizes(p.shape), sizes(p.stride), dtype=p.dtype,
                                     device=p.device)
                 for p in inputs]
    layout = layout or symbolic.Layout(inputs)
    return fakes + sizes([inputs[k].shape[d] for k, d, _ in layout.extra])


def shape_env(inputs: list[TensorProxy]):
    """The capture's ``ShapeEnv`` when the region has symbolic sizes, else None."""
    values = []
    for p in inputs:
        if float_symbols.is_float_symbol(p):
            continue  # a tensor to the kernel (its stand-in), not a size
        values += [p.value] if isinstance(p, NumberProxy) else [*p.shape, *p.stride]
    return symbolic.shape_env_of(values)


def propagate(gm: fx.GraphModule, fakes: list[torch.Tensor], fake_mode,
              outputs: list[TensorProxy]) -> None:
    """Run the graph on the fakes: each node's ``example_value`` (Inductor's caches want one for
    every tensor a method is called on), and a check that the graph makes what the trace says."""
    made = example_values(gm, fakes, fake_mode)
    expr = symbolic.expr_of  # never ``==`` on SymInts: it would record a guard
    for p, t in zip(outputs, made):
        if (tuple(map(expr, t.shape)), t.dtype) != (tuple(map(expr, p.shape)), p.dtype):
            raise AssertionError(f"the region's graph makes {p.name} as {tuple(t.shape)} "
                                 f"{t.dtype}, the trace says {p.shape} {p.dtype}")


def example_values(gm: fx.GraphModule, fakes: list[torch.Tensor], fake_mode) -> list:
    """Run the graph on the fakes, giving each node its ``example_value`` (Inductor's caches want
    one for every tensor a method is called on); the graph's outputs."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    with torch.no_grad():
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    return next(n for n in gm.graph.nodes if n.op == "output").meta["val"]


def alias_pattern(inputs: list[TensorProxy]) -> tuple:
    """Which inputs share memory: for each input, the position of the first input sharing it."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(p.storage, k) if getattr(p, "storage", None) is not None else k
                 for k, p in enumerate(inputs))


def region_key(graph: fx.Graph, inputs: list[TensorProxy], environment: tuple) -> tuple:
    """What decides the compiled code: the ops and constants (the graph's code, free of trace
    names), each input's metadata, which inputs share memory, and the compile environment;
    with symbolic sizes, their expressions and what the ``ShapeEnv`` knows about them."""
    expr = symbolic.expr_of
    metas = tuple(float_symbols.STAND_IN if float_symbols.is_float_symbol(p) else
                  ("int", p.symbol) if isinstance(p, NumberProxy) else
                  (tuple(map(expr, p.shape)), tuple(map(expr, p.stride)), p.dtype, p.device)
                  for p in inputs)
    env = shape_env(inputs)
    facts = symbolic.baseline(env)[0] if env is not None else None  # what the prologue checks
    return (graph.python_code(root_module="self").src, metas, alias_pattern(inputs), environment,
            facts)
