"""``torch.distributed``'s in-place collectives during capture: recorded as functional ones.

``dist.all_reduce(t)`` writes ``t`` in place by talking to the other ranks. On fake tensors it
would do nothing (the c10d kernel is a no-op there), so a trace that recorded only what ran
would silently skip it. Instead, capture records what it means: the functional collective of
``torch.distributed._functional_collectives`` (a value the trace holds, waited for at once) and
an in-place ``copy_`` of the result into the tensor the user passed, which the epilogue writes
back like any other in-place write. In the trace::

    t1 = torch.ops._c10d_functional.all_reduce(t0, 'sum', '0')
    t2 = torch.ops._c10d_functional.wait_tensor(t1)
    t3 = t0.copy_(t2)

Torch defines no gradient for the in-place collectives (eager warns and lets the gradient
through unchanged), so one that writes a tensor requiring grad is refused; the differentiable
functional collectives (``all_gather_tensor_autograd``, ...) are recorded with their own
gradients, like any torch call. Everything else a program
may call in ``torch.distributed`` that exchanges data (``async_op=True``, point-to-point
``send``/``recv``, ``barrier``, ``scatter``, ``gather``, ``reduce``, coalesced collectives, and
any C++ method of a process group, work or reducer, see ``interceptors``) is refused with a
clear error: never dropped.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..errors import CaptureError, user_source


def _functional():
    import torch.distributed._functional_collectives as funcol
    return funcol


def _reduce_op(op: Any, name: str) -> str:
    funcol = _functional()
    if isinstance(op, str):
        return op
    try:
        return funcol.REDUCE_OP_TO_STR[op]
    except (KeyError, TypeError):
        raise CaptureError(
            f"keraunos cannot capture {user_source()}\n  `torch.distributed.{name}` with "
            f"op={op!r}: only the plain reductions (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR) "
            f"have a functional collective.\n  What to do: use one of those, or call the "
            f"collective outside the jitted function.") from None


def _group(group):
    return group if group is not None else torch.distributed.group.WORLD


def _all_reduce(a):
    funcol = _functional()
    funcol.all_reduce_inplace(a["tensor"], _reduce_op(a["op"], "all_reduce"), _group(a["group"]))


def _all_gather_into_tensor(a):
    funcol = _functional()
    out = a["output_tensor"]
    out.copy_(funcol.all_gather_tensor(a["input_tensor"], 0, _group(a["group"])).view_as(out))


def _all_gather(a):
    funcol = _functional()
    funcol.all_gather_inplace(a["tensor_list"], a["tensor"], _group(a["group"]))


def _reduce_scatter_tensor(a):
    funcol = _functional()
    out = a["output"]
    out.copy_(funcol.reduce_scatter_tensor(a["input"], _reduce_op(a["op"], "reduce_scatter_tensor"),
                                           0, _group(a["group"])).view_as(out))


def _all_to_all_single(a):
    funcol = _functional()
    funcol.all_to_all_inplace(a["output"], a["input"], a["output_split_sizes"],
                              a["input_split_sizes"], _group(a["group"]))


def _broadcast(a):
    funcol = _functional()
    dist = torch.distributed
    group = _group(a["group"])
    src = a["group_src"]
    if src is None:  # dist.broadcast's src is a global rank; the functional one's a group rank
        src = a["src"] if group is dist.group.WORLD else dist.get_group_rank(group, a["src"])
    tensor = a["tensor"]
    tensor.copy_(funcol.broadcast(tensor, src, group))


# torch.distributed's function name -> what capture records in its place.
_REMAPS: dict[str, Callable[[dict], None]] = {
    "all_reduce": _all_reduce,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "_all_gather_base": _all_gather_into_tensor,
    "all_gather_single": _all_gather_into_tensor,  # what all_gather_into_tensor calls
    "all_gather": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "_reduce_scatter_base": _reduce_scatter_tensor,
    "reduce_scatter_single": _reduce_scatter_tensor,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast,
}


def is_distributed_function(func) -> bool:
    """A function of ``torch.distributed`` other than a functional collective (those return
    values and are recorded like any torch call)."""
    module = getattr(func, "__module__", None) or ""
    return (module.startswith("torch.distributed")
            and not module.startswith("torch.distributed._functional_collectives")
            and not module.startswith("torch.distributed.tensor"))


def capture_collective(recorder, func, args: tuple, kwargs: dict) -> None:
    """Record ``func(*args, **kwargs)`` (an in-place collective of ``torch.distributed``) as its
    functional collective and the write, with ``recorder`` (the capture's torch function mode)
    on, so that every op of the replacement is recorded."""
    name = getattr(func, "__name__", repr(func))
    remap = _REMAPS.get(name)
    if remap is None:
        raise CaptureError(
            f"keraunos cannot capture {user_source()}\n  it calls `torch.distributed.{name}`, "
            f"which keraunos has no functional form for: on later calls the trace would not "
            f"communicate, so the call would silently not happen.\n  What to do: use "
            f"all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single or "
            f"broadcast (or the functional collectives of "
            f"torch.distributed._functional_collectives), or call it outside the jitted function.")
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments.get("async_op"):
        raise CaptureError(
            f"keraunos cannot capture {user_source()}\n  `torch.distributed.{name}(..., "
            f"async_op=True)` returns a Work handle whose wait() the trace cannot place.\n  "
            f"What to do: call it with async_op=False (the default) inside the jitted function; "
            f"keraunos records it as a functional collective that the trace waits for.")
    tensors = [t for t in pytree.tree_leaves(list(arguments.values()))
               if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise CaptureError(
            f"keraunos cannot capture {user_source()}\n  `torch.distributed.{name}` writes a "
            f"tensor that requires grad; torch defines no gradient for the in-place collectives "
            f"(eager warns that no autograd kernel is registered and lets the gradient through "
            f"as if nothing had been exchanged), and keraunos does not guess one.\n  What to "
            f"do: run it under torch.no_grad() or on a .detach()ed tensor, or use the "
            f"differentiable functional collectives (all_gather_tensor_autograd, "
            f"reduce_scatter_tensor_autograd, all_to_all_single_autograd in "
            f"torch.distributed._functional_collectives).")
    with recorder:  # the mode is off inside its own __torch_function__: on again for the parts
        remap(arguments)
    return None
