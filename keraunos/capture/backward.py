"""A backward the program runs itself (``loss.backward()``, ``torch.autograd.backward``,
``torch.autograd.grad``): a training step written as one function.

Capture records it as one line, ``backward_in_program(outputs, grad_outputs, inputs=...)``,
whose outputs are the gradients, and goes on: the gradients' accumulation into ``.grad`` is
lines and writes like any other (``.grad`` set where it was ``None``, added to in place where
it was a tensor, as autograd's engine does), so what reads them next (clipping, an optimizer's
step) is captured as it reads them. Before anything else runs on the computation, the line is
expanded into the forward and backward it stands for (``autograd/in_program.py``).

What this cannot give eager's meaning to is refused with ``BackwardInProgramError``, which
takes the fallback route: a graph that goes on outside the program (an input that is not a
leaf), leaves made inside the program, hooks on the leaves, ``create_graph``."""
from __future__ import annotations

import inspect

import torch

from ..core.autograd_graph import leaves_reached
from ..core.symbols import BoundSymbol, TorchSymbol
from ..errors import BackwardInProgramError, user_source


def backward_in_program(outputs, grad_outputs, inputs=()):
    """The line capture records for a backward inside the program; expanded before it runs."""
    raise RuntimeError("keraunos: a backward_in_program line was left in a trace that runs "
                       "(it is expanded right after capture)")


def fresh_grad(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s new ``.grad`` made from ``grad`` as autograd's engine stores it when it cannot
    keep ``grad`` itself: memory of its own, with ``like``'s strides when ``like`` is dense and
    non-overlapping, else contiguous."""
    if dense_layout(like.shape, like.stride()):
        out = torch.empty_strided(like.shape, like.stride(), dtype=grad.dtype, device=grad.device)
    else:
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    return out.copy_(grad)


def dense_layout(shape, strides) -> bool:
    """Whether elements of these sizes and strides fill their memory without gaps or
    overlap, in some order of the dimensions."""
    expected = 1
    for size, stride in sorted(zip(shape, strides), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


_BACKWARD_SYMBOL = TorchSymbol(backward_in_program, "backward_in_program", "opaque")
_FRESH_GRAD_SYMBOL = TorchSymbol(fresh_grad, "fresh_grad", "opaque")


def record_backward(recorder, func, args, kwargs):
    """Capture ``func(*args, **kwargs)``, one of autograd's three backward entry points."""
    ctx = recorder.ctx
    call = inspect.signature(func).bind(*args, **kwargs).arguments
    accumulate = func is not torch.autograd.grad
    if func is torch.Tensor.backward:
        outputs, grad_outputs = call["self"], call.get("gradient")
    elif func is torch.autograd.backward:
        outputs, grad_outputs = call["tensors"], call.get("grad_tensors")
    else:
        outputs, grad_outputs = call["outputs"], call.get("grad_outputs")
    outputs = _as_list(outputs)
    grad_outputs = _as_list(grad_outputs) if grad_outputs is not None else [None] * len(outputs)
    inputs = call.get("inputs")
    inputs = _as_list(inputs) if inputs is not None else None
    if call.get("create_graph") or call.get("is_grads_batched") or call.get("materialize_grads"):
        which = next(k for k in ("create_graph", "is_grads_batched", "materialize_grads")
                     if call.get(k))
        raise _refused(f"it is called with {which}=True, a backward that is itself "
                       f"differentiated or batched")
    retain_graph = call.get("retain_graph")
    if retain_graph is None:
        retain_graph = bool(call.get("create_graph"))
    for t in outputs + [g for g in grad_outputs if g is not None]:
        if isinstance(t, torch.Tensor):
            ctx.proxy(t)  # a tensor the program knows (an internal error otherwise)
    leaves = inputs if inputs is not None else _leaves_reached(outputs)
    for leaf in leaves:
        _check_leaf(ctx, leaf)
    # Autograd on the fakes: eager's errors (an output that does not require grad, a gradient
    # of the wrong shape, a graph already freed) where eager raises them, and the gradients'
    # metadata.
    grads = torch.autograd.grad(outputs, leaves, grad_outputs, retain_graph=retain_graph,
                                allow_unused=True)
    if not accumulate and not call.get("allow_unused"):
        for leaf, g in zip(leaves, grads):
            if g is None:
                torch.autograd.grad(outputs, [leaf], grad_outputs, allow_unused=False)
    made = []
    for out, g in zip(outputs, grad_outputs):
        if g is None:  # autograd's implicit gradient of a scalar
            g = recorder._record(torch.ones_like, (), (out,),
                                 {"memory_format": torch.preserve_format})
        made.append(g)
    produced = [g for g in grads if g is not None]
    reached = [leaf for leaf, g in zip(leaves, grads) if g is not None]
    ctx.emit(BoundSymbol(
        _BACKWARD_SYMBOL, ([ctx.proxy(o) for o in outputs], [ctx.proxy(g) for g in made]),
        {"inputs": tuple(ctx.proxy(leaf).name for leaf in reached)},
        tuple(ctx.output_proxy(g) for g in produced), user_source(),
        comment="expanded into its forward and backward before the program runs"))
    if not accumulate:
        return tuple(grads)
    with torch.no_grad():  # autograd's engine accumulates with grad mode off
        for leaf, g in zip(reached, produced):
            _accumulate(recorder, leaf, g)
    return None


def _accumulate(recorder, leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """``leaf.grad`` after the backward, as autograd's ``AccumulateGrad`` leaves it: the new
    gradient where it was ``None`` (memory of its own, laid out as ``leaf``), else the old one
    with the new one added in place."""
    ctx = recorder.ctx
    now = ctx.current_grad(leaf)
    if now is None:
        new = fresh_grad(grad, leaf)
        ctx.record(_FRESH_GRAD_SYMBOL, (grad, leaf), {}, new, [])
        ctx.write_grad(leaf, new)
    else:
        recorder._record(torch.Tensor.add_, (torch.Tensor,), (now, grad), {})


def _as_list(x) -> list:
    if isinstance(x, torch.Tensor) or x is None:
        return [x]
    return list(x)


def _leaves_reached(outputs: list) -> list[torch.Tensor]:
    """The leaves requiring grad whose ``AccumulateGrad`` the outputs' graph reaches, in the
    order the walk meets them (an output that is a leaf itself included)."""
    found: dict[int, torch.Tensor] = {}
    stack, seen = [], set()
    for out in outputs:
        if isinstance(out, torch.Tensor):
            if out.requires_grad and out.grad_fn is None:
                found.setdefault(id(out), out)
            stack.append(out.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return list(found.values())


def _check_leaf(ctx, leaf) -> None:
    entry = ctx.input_entry(leaf) if isinstance(leaf, torch.Tensor) else None
    if entry is None:
        for other in ctx.inputs:  # the stand-in of an input that is not a leaf is not one either
            if other.real.grad_fn is not None and other.fake.requires_grad and \
                    leaves_reached(other.fake, {id(leaf)}):
                raise _not_a_leaf(other)
        raise _refused("its gradients go to a tensor made inside the program (a leaf created "
                       "there with requires_grad=True, or an intermediate value)")
    real = entry.real
    if real.grad_fn is not None:
        raise _not_a_leaf(entry)
    if getattr(real, "_backward_hooks", None) or \
            getattr(real, "_post_accumulate_grad_hooks", None):
        raise _refused(f"{entry.path} has autograd hooks (DistributedDataParallel, FSDP, or "
                       f"the program's own), which the compiled step would not call")


def _not_a_leaf(entry) -> BackwardInProgramError:
    return _refused(f"{entry.path} is not a leaf: its graph goes on outside the program, where "
                    f"eager's backward goes too")


def _refused(why: str) -> BackwardInProgramError:
    return BackwardInProgramError(
        f"keraunos cannot capture {user_source()}\n  This backward runs inside the program, "
        f"and {why}.\n  What to do: keep the default fallback=\"dynamo\", which runs the step "
        f"with the graphs around the backward compiled; or jit the model and run the backward "
        f"outside it.")
