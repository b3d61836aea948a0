"""Derivative rules of ours, each registered against the op it replaces.

Everything else is derived from PyTorch's own formulas (``joint.py``). A rule earns its place by
being better than PyTorch's: simpler, or fewer saved tensors. The joint recording calls the rule
in place of the op, so the backward it records is the rule's.

A rule is keyed by the op object itself (``torch.nn.functional.layer_norm``), never by its printed
name, so that renaming how an op prints cannot silently drop its rule::

    @derivative_rule(torch.nn.functional.layer_norm)
    def _layer_norm_rule(input, normalized_shape, weight=None, bias=None, eps=1e-5): ...
"""
from __future__ import annotations

from typing import Callable

import torch

from ..torch_internals import dispatch

# The op as capture records it (``TorchSymbol.fn``) -> a function with the op's signature that
# computes it through an autograd.Function of ours.
DERIVATIVE_RULES: dict[Callable, Callable] = {}


def derivative_rule(op: Callable):
    """Register the decorated function as the derivative rule for ``op``."""
    def register(rule: Callable) -> Callable:
        if op in DERIVATIVE_RULES:
            raise ValueError(f"a derivative rule for {op} is already registered")
        DERIVATIVE_RULES[op] = rule
        return rule
    return register


def rule_for(op: Callable) -> Callable:
    """What the joint recording calls for ``op``: our rule, or the op itself."""
    try:
        return DERIVATIVE_RULES.get(op, op)
    except TypeError:  # an unhashable callable has no rule
        return op


class _LayerNorm(torch.autograd.Function):
    """layer_norm saving only its input, weight and bias. PyTorch's formula also saves the mean
    and the reciprocal standard deviation, which exist only inside ``native_layer_norm``: the
    forward would have to run as ATen ops to hand them over. Recomputing them in the backward is
    one cheap reduction, and the forward stays ``torch.nn.functional.layer_norm``."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        ctx.save_for_backward(x, weight, bias)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        shape = list(ctx.normalized_shape)
        _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, shape, weight, bias, ctx.eps)
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward.default(
            grad, x, shape, mean, rstd, weight, bias, mask)
        return gx, None, gw, gb, None


@derivative_rule(torch.nn.functional.layer_norm)
def _layer_norm_rule(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _LayerNorm.apply(input, tuple(normalized_shape), weight, bias, eps)


# Recurrent layers (nn.LSTM, nn.GRU, nn.RNN call these). On CPU, PyTorch runs them as oneDNN's
# ``mkldnn_rnn_layer``, whose workspace, saved for the backward, exists only when grad mode is on;
# the forward trace runs under no_grad (inside the autograd.Function), so the backward would get
# none. The native route computes the same cells from linear and pointwise ops, whose saved
# tensors exist in any grad mode (and which fusion regions can take).
def _without_onednn(op: Callable) -> Callable:
    def rule(*args, **kwargs):
        enabled = dispatch.get_mkldnn_enabled()
        dispatch.set_mkldnn_enabled(False)
        try:
            return op(*args, **kwargs)
        finally:
            dispatch.set_mkldnn_enabled(enabled)
    rule.__name__ = f"{op.__name__}_without_onednn"
    return rule


for _rnn in dispatch.RNN_OPS:
    derivative_rule(_rnn)(_without_onednn(_rnn))
