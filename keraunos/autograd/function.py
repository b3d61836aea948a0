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

from ..torch_internals.autograd import clear_saved_tensors
from ..torch_internals.functorch import transforms_active as _transforms_active


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
        return writable_outputs(outputs, inputs)

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
        grads = [g if g is not None else _zeros(ctx, i) for i, g in enumerate(grads)]
        grads = [_laid_out(g, s) for g, s in zip(grads, compiled.grad_strides)]
        # The backward takes its inputs in a list it empties, and autograd lets go of the saved
        # tensors (unless the graph is retained): each is freed at its last use, as eager's
        # backward frees them node by node.
        inputs = [*ctx.saved_tensors, *ctx.saved_sizes, *grads]
        del grads
        clear_saved_tensors(ctx)
        results = compiled.backward_fn(inputs)
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


def writable_outputs(outputs, inputs) -> tuple:
    """``outputs``, each view of a tensor the forward made (a linear's 3-d result, a view of its
    2-d product) that is the only output on its memory given as a tensor of its own (a detached
    alias: the same memory and version counter). A Function's output that is a view is one
    autograd forbids writing in place (a view from a function of several outputs), where
    eager's, a view of a temporary, may be written (``y += b`` after the model)."""
    views = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t._is_view()]
    if not views:
        return outputs
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    outputs = list(outputs)
    for i in views:
        base = outputs[i]._base
        if any(base is x or base is getattr(x, "_base", None) for x in inputs):
            continue  # a view of an input stays one, as in eager
        memory = base.untyped_storage().data_ptr()
        if sum(t.untyped_storage().data_ptr() == memory for t in tensors) == 1:
            outputs[i] = outputs[i].detach()
    return tuple(outputs)


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
    transforms_active = _transforms_active

    def computation_with_autograd(*inputs):
        if transforms_active():
            return apply(compiled, *inputs)
        return apply_in_c(compiled, *inputs)
    return computation_with_autograd


# --------------------------------------------- the backward as several nodes (DDP's buckets)
class _Call:
    """One call's values, handed from node to node (see ``make_segmented_computation``)."""

    __slots__ = ("inputs", "outputs", "saved", "carry", "present")

    def __init__(self, inputs):
        self.inputs = inputs
        self.present = None


def _save(ctx, saved: list, indices: list[int], detach_all: bool) -> None:
    # A node saves what its own segment reads. Tensors that become another node's outputs are
    # saved as detached aliases (same memory and version counter, so in-place changes are still
    # caught): saved as they are, they would hold that node, which holds this one.
    ctx.save_for_backward(*[saved[i].detach() if detach_all or saved[i]._is_view()
                            else saved[i] for i in indices])


def _run_segment(ctx, k: int) -> tuple:
    """Segment ``k`` of the backward: the gradients of the node's inputs; what later segments
    read stays with the call."""
    call, compiled = ctx.call, ctx.compiled
    segment, fn = compiled.segments[k]
    if not call.present:
        return (None,) * len(segment.inputs)
    results = fn(*ctx.saved_tensors, *call.carry)
    n = len(segment.gradients)
    call.carry = results[n:]
    by_input = dict(zip(segment.gradients, results[:n]))
    deps, present = compiled.grad_dependencies, call.present
    return tuple(r if r is None or deps[i] & present or not deps[i] else None
                 for i, r in ((i, by_input.get(i)) for i in segment.inputs))


class _FirstNode(torch.autograd.Function):
    """First in the forward, last in the backward: runs the whole forward program, and in the
    backward the last segment (the gradients of the first layers)."""

    @staticmethod
    def forward(ctx, compiled, call, *node_inputs):
        outputs, saved = compiled.forward_fn(*call.inputs)
        call.inputs = None
        call.outputs, call.saved = outputs, saved
        ctx.compiled, ctx.call = compiled, call
        ctx.set_materialize_grads(False)
        _save(ctx, saved, compiled.segments[-1][0].saved, True)
        return compiled.token()

    @staticmethod
    def backward(ctx, _token_grad):
        return (None, None, *_run_segment(ctx, len(ctx.compiled.segments) - 1))


class _MiddleNode(torch.autograd.Function):
    """A segment between the first and the last: its gradients, then the next segment's turn."""

    @staticmethod
    def forward(ctx, compiled, call, k, token, *node_inputs):
        ctx.compiled, ctx.call, ctx.k = compiled, call, k
        ctx.set_materialize_grads(False)
        _save(ctx, call.saved, compiled.segments[k][0].saved, True)
        return compiled.token()

    @staticmethod
    def backward(ctx, _token_grad):
        return (None, None, None, ctx.compiled.token(), *_run_segment(ctx, ctx.k))


class _OutputNode(torch.autograd.Function):
    """Last in the forward, first in the backward: returns the program's outputs and takes
    their gradients, as ``KeraunosFunction`` does, and runs the first segment."""

    @staticmethod
    def forward(ctx, compiled, call, token, *node_inputs):
        outputs, saved = call.outputs, call.saved
        call.outputs = call.saved = None
        ctx.compiled, ctx.call = compiled, call
        ctx.set_materialize_grads(False)
        _save(ctx, saved, compiled.segments[0][0].saved, False)
        ctx.saved_sizes = saved[compiled.n_saved_tensors:]
        if compiled.non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in compiled.non_differentiable])
        if compiled.data_dependent_shapes:
            ctx.grad_shapes = {i: outputs[compiled.differentiable[i]].shape
                               for i in compiled.data_dependent_shapes}
        return writable_outputs(outputs, call.inputs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            return KeraunosFunction.backward(ctx, *grads)  # raises: not differentiable twice
        compiled, call = ctx.compiled, ctx.call
        grads = [grads[i] for i in compiled.differentiable]
        call.present = {i for i, g in enumerate(grads) if g is not None}
        if call.present:
            grads = [g if g is not None else _zeros(ctx, i) for i, g in enumerate(grads)]
            grads = [_laid_out(g, s) for g, s in zip(grads, compiled.grad_strides)]
            call.carry = (*ctx.saved_sizes, *grads)
        return (None, None, compiled.token(), *_run_segment(ctx, 0))


class _SegmentedCompiled(_Compiled):
    def __init__(self, forward_fn, segments, split, device):
        super().__init__(forward_fn, None, split)
        self.segments = segments  # [(Segment, its callable)], in the order the backward runs
        self.token = lambda: torch.empty(0, device=device)


def make_segmented_computation(forward_fn: Callable, segment_fns: list[Callable], plan,
                               split, device) -> Callable:
    """The computation callable of an entry whose backward is several autograd nodes, one per
    segment of ``plan`` (``buckets.py``): a chain of nodes joined by empty "token" tensors, so
    that autograd runs segment 0 first (it gets the outputs' gradients), hands its gradients to
    their parameters' ``AccumulateGrad`` (where DDP's reducer hooks in), then runs segment 1,
    and so on. The forward program runs once, in the first node; the values segments hand on
    travel in a ``_Call`` that the nodes share."""
    compiled = _SegmentedCompiled(forward_fn, list(zip(plan.segments, segment_fns)), split,
                                  device)
    first, last = len(plan.segments) - 1, 0
    node_inputs = [s.inputs for s in plan.segments]
    transforms_active = _transforms_active
    applies = [(n.apply, super(torch.autograd.Function, n).apply)
               for n in (_FirstNode, _MiddleNode, _OutputNode)]

    def computation_with_segmented_backward(*inputs):
        (first_apply, middle_apply, output_apply) = (
            [a for a, _ in applies] if transforms_active() else [c for _, c in applies])
        call = _Call(inputs)
        token = first_apply(compiled, call, *[inputs[i] for i in node_inputs[first]])
        for k in range(first - 1, last, -1):
            token = middle_apply(compiled, call, k, token, *[inputs[i] for i in node_inputs[k]])
        return output_apply(compiled, call, token, *[inputs[i] for i in node_inputs[last]])
    return computation_with_segmented_backward
