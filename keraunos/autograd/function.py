"""The ``torch.autograd.Function`` that connects a forward and a backward trace to the user's graph.

The forward trace runs inside ``Function.forward`` (grad mode off, as for any Function) and
returns the outputs and the tensors the backward needs, which are saved with
``ctx.save_for_backward`` (so in-place changes to them after the call are caught as in eager).
Outputs that do not get gradients (integer tensors, values computed under ``no_grad``) are marked
non-differentiable. The backward is not itself differentiable: with ``create_graph=True`` it raises
a clear error instead of returning gradients that silently lack their own graph.
"""
from __future__ import annotations

from typing import Callable

import torch


class KeraunosFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled, *inputs):
        outputs, saved = compiled.forward_fn(*inputs)
        ctx.compiled = compiled
        ctx.set_materialize_grads(False)  # an output the loss ignores gets None, not zeros
        # A saved view of memory written after the view was made (``x.unsqueeze(0).exp_()``)
        # is a view made under no_grad whose base changed: autograd refuses to unpack it once
        # that base is an output that requires grad. Its detached alias holds the same memory
        # and version counter, so in-place changes after the call are still caught.
        n = compiled.n_saved_tensors
        ctx.save_for_backward(*[t.detach() if t._is_view() else t for t in saved[:n]])
        ctx.saved_sizes = saved[n:]  # sizes that depend on data (the length of ``x[mask]``)
        if compiled.non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in compiled.non_differentiable])
        if compiled.data_dependent_shapes:  # for the zeros of a gradient that does not come
            ctx.grad_shapes = {i: outputs[compiled.differentiable[i]].shape
                               for i in compiled.data_dependent_shapes}
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: a double backward was asked for
            raise RuntimeError(
                "keraunos: differentiating twice (create_graph=True, a gradient penalty, "
                "higher-order grads) through a jitted function is not supported yet: its backward "
                "trace is not itself differentiable. Compute this part without keraunos.jit.")
        compiled = ctx.compiled
        grads = [grads[i] for i in compiled.differentiable]
        present = {i for i, g in enumerate(grads) if g is not None}
        if not present:
            # Before the saved tensors: autograd runs every node a backward reaches, with no
            # gradient where none flows, and an earlier call's node (reached through a buffer
            # this call overwrote) has freed its saved tensors in its own backward.
            return (None,) * (1 + len(compiled.grad_dependencies))
        saved = ctx.saved_tensors
        grads = [g if g is not None else _zeros(ctx, i) for i, g in enumerate(grads)]
        grads = [_laid_out(g, s) for g, s in zip(grads, compiled.grad_strides)]
        results = compiled.backward_fn(*saved, *ctx.saved_sizes, *grads)
        # An input reached only through outputs that got no gradient gets None, as in eager
        # (an optimizer skips it rather than stepping it with zeros).
        return (None, *(r if deps & present or not deps else None
                        for r, deps in zip(results, compiled.grad_dependencies)))


def _laid_out(grad: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """``grad`` with the strides the backward trace was recorded for (those of its output):
    the trace's ``view(grad0, ...)`` fails on a gradient of other strides that eager's
    autograd accepts (``out.backward(g.permute(...))``), and fused regions read memory by the
    recorded strides. A copy only when the element order differs."""
    if stride is None or grad.stride() == stride:
        return grad
    if all(a == b or n <= 1 for a, b, n in zip(grad.stride(), stride, grad.shape)):
        return grad
    return torch.empty_strided(grad.shape, stride, dtype=grad.dtype,
                               device=grad.device).copy_(grad)


def _zeros(ctx, i: int) -> torch.Tensor:
    """The gradient of differentiable output ``i`` when none came: zeros of its shape."""
    shape, dtype, device = ctx.compiled.grad_metadata[i]
    if i in ctx.compiled.data_dependent_shapes:
        shape = ctx.grad_shapes[i]
    return torch.zeros(shape, dtype=dtype, device=device)


class _Compiled:
    def __init__(self, forward_fn, backward_fn, split):
        self.forward_fn = forward_fn
        self.backward_fn = backward_fn
        self.differentiable = list(split.differentiable)
        self.non_differentiable = [i for i in range(split.n_outputs)
                                   if i not in split.differentiable]
        self.grad_dependencies = split.grad_dependencies
        self.grad_metadata = split.grad_metadata
        # The recorded strides of each incoming gradient (None where symbolic): the joint trace
        # made them ``empty_like`` the output, so never overlapping memory.
        grads = split.backward.params[len(split.backward.params) - len(split.grad_metadata):]
        self.grad_strides = [tuple(p.stride) if all(type(v) is int for v in p.stride) else None
                             for p in grads]
        self.n_saved_tensors = split.n_saved_tensors
        self.data_dependent_shapes = [i for i, (shape, _, _) in enumerate(split.grad_metadata)
                                      if not all(type(d) is int for d in shape)]


def make_autograd_computation(forward_fn: Callable, backward_fn: Callable, split) -> Callable:
    """The computation callable of a cache entry with a backward."""
    compiled = _Compiled(forward_fn, backward_fn, split)
    apply = KeraunosFunction.apply
    # ``Function.apply`` runs Python before its C apply: a check for ``setup_context`` (this
    # Function has none) and, outside functorch transforms, an unwrap of dead functorch wrappers
    # (a generator and a call per argument: a sixth of an MLP's hit in grad mode). The inputs of
    # a hit passed the prologue's tensor checks, whose dispatch keys tell any functorch wrapper
    # apart, so outside transforms the C apply gets them directly; inside one, ``apply`` as is.
    apply_in_c = super(torch.autograd.Function, KeraunosFunction).apply
    transforms_active = torch._C._are_functorch_transforms_active

    def computation_with_autograd(*inputs):
        if transforms_active():
            return apply(compiled, *inputs)
        return apply_in_c(compiled, *inputs)
    return computation_with_autograd
