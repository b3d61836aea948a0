"""Walks of a tensor's autograd graph (``grad_fn`` and its ``next_functions``)."""
from __future__ import annotations

import torch


def leaves_reached(value: torch.Tensor, leaf_ids: set[int]) -> set[int]:
    """The ids, among ``leaf_ids``, of the leaf tensors whose gradients ``value``'s autograd
    graph accumulates (their ``AccumulateGrad`` nodes), ``value`` itself included when it is
    one of them."""
    reached = {id(value)} & leaf_ids
    stack, seen = [value.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf's gradient
        if variable is not None and id(variable) in leaf_ids:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached
