"""A learning-rate scheduler stepped inside the program: its step runs after the computation.

``scheduler.step()`` changes Python state only: its epoch counter and the learning rates it
writes into its optimizer's ``param_groups``, which the next call's optimizer step reads. A
trace holds no such state, and made during capture the step would be made once. So capture
records the call instead, and the epilogue makes it on every call after the computation has run,
with the scheduler the prologue finds (the same object, by its path). The flag the scheduler's
wrapper of ``optimizer.step`` sets (``_opt_called``) is an attribute write the epilogue replays,
before the step, as in eager.

That is eager's order only if the step is the last thing the program does with the scheduler and
its optimizer: a later ``optimizer.step()``, ``get_last_lr()`` or read of ``param_groups`` would
see the values from before the step. Such a read is refused (``ScopeMutationError``: the default
fallback route runs the program); ``optimizer.zero_grad()`` after the step reads no learning
rate, and is allowed.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..errors import ScopeMutationError, user_source
from .replayed import Found, ReplayedCall, snapshot

# What the scheduler's wrapper of ``optimizer.step`` sets on the optimizer (torch's
# ``LRScheduler.__init__``): replayed by the epilogue, not refused as a change of the optimizer.
OPTIMIZER_FLAG = "_opt_called"


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, LRScheduler)


def replayed_flag(obj: Any, name: str, value: Any) -> bool:
    """Whether ``obj.name = value`` is the step wrapper's flag, which the epilogue replays."""
    return name == OPTIMIZER_FLAG and value is True and isinstance(obj, torch.optim.Optimizer)


def deferred_step(ctx, scheduler: LRScheduler, path):
    """The stand-in of ``scheduler.step`` while capturing: records the call for the epilogue
    and marks the scheduler and its optimizer as stepped."""
    def step(*args, **kwargs):
        ctx.stepped_schedulers.add(id(scheduler))
        optimizer = object.__getattribute__(scheduler, "__dict__").get("optimizer")
        if optimizer is not None:
            ctx.stepped_schedulers.add(id(optimizer))
        ctx.replayed_calls.append(ReplayedCall(
            _step, f"{type(scheduler).__name__}.step", (), (Found(path), *snapshot(args)),
            snapshot(kwargs), user_source()))
    return step


def _step(scheduler, *args, **kwargs):
    """What the epilogue calls: the step of the scheduler the prologue found."""
    return scheduler.step(*args, **kwargs)


def read_after_step(ctx, obj: Any, name: str, read) -> Any:
    """``obj.name`` (``read()``) after ``obj``, a scheduler or its optimizer, was stepped:
    refused, but for the optimizer's ``zero_grad`` and what it reads."""
    if ctx.zeroing_after_step:
        return read()
    if name == "zero_grad" and isinstance(obj, torch.optim.Optimizer):
        method = read()

        def zero_grad(*args, **kwargs):
            ctx.zeroing_after_step = True
            try:
                return method(*args, **kwargs)
            finally:
                ctx.zeroing_after_step = False
        return zero_grad
    raise ScopeMutationError(
        f"keraunos cannot capture this program as one trace: it reads {type(obj).__name__}."
        f"{name} at {user_source()}, after the learning-rate scheduler's step, which keraunos "
        f"makes after the program's computation (the step changes Python state: the optimizer's "
        f"learning rates, the scheduler's counters).\n  What to do: keraunos.jit(..., "
        f"fallback=\"dynamo\") (the default) runs it through torch.compile(backend=\"keraunos\"); "
        f"or make scheduler.step() the program's last use of the scheduler and its optimizer.")
