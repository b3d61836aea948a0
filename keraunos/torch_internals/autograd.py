"""Autograd's private switches: grad mode as generated code sets it, the default saved-tensor
hooks, forward-mode AD's level, and ``torch.autograd.Function.apply``'s descriptor.

Release difference: ``Function.__dict__["apply"]`` is a Python ``classmethod`` up to torch 2.13
and a C ``classmethod_descriptor`` from 2.14; either binds to a Function subclass with
``__get__(None, cls)``, which ``apply_of`` does (``apply_descriptor_kind`` says which this torch
has).
"""
from __future__ import annotations

import torch

set_grad_enabled = torch._C._set_grad_enabled
# The same call as generated code spells it (``torch`` is in every generated namespace).
SET_GRAD_ENABLED_SOURCE = "torch._C._set_grad_enabled"

top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
pop_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks

exit_dual_level = torch._C._exit_dual_level

# The descriptor itself, read when keraunos is imported (before any capture replaces it).
FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


def apply_descriptor_kind() -> str:
    """"classmethod" (torch 2.13) or "classmethod_descriptor" (from 2.14)."""
    return type(FUNCTION_APPLY).__name__


def apply_of(cls):
    """``cls.apply`` as torch defines it, whatever replaces ``Function.apply`` meanwhile."""
    return FUNCTION_APPLY.__get__(None, cls)


__all__ = ["FUNCTION_APPLY", "SET_GRAD_ENABLED_SOURCE", "apply_descriptor_kind", "apply_of",
           "exit_dual_level", "pop_saved_tensors_hooks", "push_saved_tensors_hooks",
           "set_grad_enabled", "top_saved_tensors_hooks"]


def allocations(prof) -> list[tuple[int, int]]:
    """``(time in ns, bytes)`` of each allocation (positive) and free (negative) a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order: the raw records,
    where ``prof.events()`` counts a free in the op that encloses it, at that op's start."""
    records = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]"]
    return sorted(records)


def marked(prof, name: str) -> int:
    """When (in the clock of ``allocations``) the ``record_function(name)`` range began."""
    return min(e.start_ns() for e in prof.profiler.kineto_results.events() if e.name() == name)


def clear_saved_tensors(ctx) -> None:
    """Let go of what ``ctx.save_for_backward`` saved, inside ``Function.backward``, unless the
    graph is retained (``retain_graph=True``): the tensors are then the backward's alone."""
    ctx.maybe_clear_saved_tensors()
