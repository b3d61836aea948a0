"""Dynamo's inlined vmap regions, turned back into ``torch.vmap`` calls that capture records.

Dynamo traces ``torch.vmap`` (transformers builds its attention masks with nested vmaps) into
explicit functorch calls: ``_vmap_increment_nesting``, ``_add_batch_dim(x, in_dim, level)``, the
body on batched tensors, ``_remove_batch_dim(y, level, batch_size, out_dim)``,
``_vmap_decrement_nesting``. Capture cannot run those on fake tensors (a batched tensor has no
storage), but it records ``torch.vmap`` itself. So each outermost region becomes one call of
``torch.vmap`` on a GraphModule of its body (its inner regions rewritten the same way)."""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ..torch_internals import functorch

_INCREMENT, _DECREMENT = functorch.vmap_increment_nesting, functorch.vmap_decrement_nesting
_ADD, _REMOVE, _LAZY = (functorch.add_batch_dim, functorch.remove_batch_dim,
                        functorch.lazy_load_decompositions)


def _vmap_of(body: GraphModule, in_dims: tuple, out_dims: tuple, randomness: str):
    """The graph's call of a region: ``torch.vmap`` of its body, looked up when it runs (capture
    swaps in its recording ``torch.vmap``). The body is a plain callable, not a submodule:
    capture would record its attribute reads as the module's."""
    def vmap_region(*args):
        return torch.vmap(body.forward, in_dims=in_dims, out_dims=out_dims,
                          randomness=randomness)(*args)
    vmap_region.__qualname__ = vmap_region.__name__  # FX names the global it refers to by this
    return vmap_region


def has_vmap_regions(gm: GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is _INCREMENT for n in gm.graph.nodes)


def rewrite_vmap_regions(gm: GraphModule) -> GraphModule:
    """``gm`` with every outermost vmap region replaced by a ``torch.vmap`` call (in place)."""
    while True:
        region = _first_region(list(gm.graph.nodes))
        if region is None:
            break
        _replace_region(gm, region)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _first_region(nodes: list[Node]) -> list[Node] | None:
    """The nodes from the first outermost increment to its matching decrement, inclusive."""
    depth, start = 0, None
    for i, n in enumerate(nodes):
        if n.op != "call_function":
            continue
        if n.target is _INCREMENT:
            if depth == 0:
                start = i
            depth += 1
        elif n.target is _DECREMENT:
            depth -= 1
            if depth == 0:
                return nodes[start:i + 1]
    return None


def _outer_level_nodes(region: list[Node]) -> tuple[list[Node], list[Node], list[Node]]:
    """The region's own ``_add_batch_dim``s and ``_remove_batch_dim``s (not its inner regions'),
    and its body."""
    adds, removes, body = [], [], []
    depth = 0
    for n in region[1:-1]:
        target = n.target if n.op == "call_function" else None
        if target is _INCREMENT:
            depth += 1
        elif target is _DECREMENT:
            depth -= 1
        if depth == 0 and target is _ADD:
            adds.append(n)
        elif depth == 0 and target is _REMOVE:
            removes.append(n)
        elif target is not _LAZY:
            body.append(n)
    return adds, removes, body


def _replace_region(gm: GraphModule, region: list[Node]) -> None:
    increment = region[0]
    batch_size, randomness = increment.args
    adds, removes, body = _outer_level_nodes(region)
    inside = set(region)
    # Values the body reads from outside the region: passed in unbatched (in_dim None).
    free: list[Node] = []
    for n in body:
        for a in n.all_input_nodes:
            if a not in inside and a not in free:
                free.append(a)
    sub = Graph()
    env: dict[Node, Node] = {}
    for n in adds:
        env[n] = sub.placeholder(n.name)
    for n in free:
        env[n] = sub.placeholder(f"free_{n.name}")
    for n in body:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[r.args[0]] if isinstance(r.args[0], Node) else r.args[0]
                     for r in removes))
    body_gm = rewrite_vmap_regions(GraphModule(gm, sub))  # its inner regions
    in_dims = tuple(n.args[1] for n in adds) + (None,) * len(free)
    out_dims = tuple(r.args[3] for r in removes)
    graph = gm.graph
    with graph.inserting_before(increment):
        call = graph.call_function(_vmap_of(body_gm, in_dims, out_dims, randomness),
                                   (*[n.args[0] for n in adds], *free))
        outputs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(removes))]
    for r, out in zip(removes, outputs):
        r.replace_all_uses_with(out)
    for n in reversed(region):  # users come after what they use: erase from the end
        graph.erase_node(n)
    del batch_size  # vmap infers it from the batched inputs

