"""Reinplace: write inputs in place directly when autograd cannot be involved.

Capture makes the computation pure: an input the program writes in place is cloned first and the
epilogue copies the new value back. When no input of the computation requires grad, or grad mode is
off, nothing can record those writes for autograd, and writing the input itself is exactly what
eager does: the clone becomes an alias and the copy-back goes. A KV cache updated with
``index_copy_`` then costs its update, not two copies of the whole cache per step.
"""
from __future__ import annotations


import torch

from ..core import glue
from ..core.tags import COPY_OF_WRITTEN_INPUT
from ..core.runner import trace_step
from ..core.trace import Trace


def can_reinplace(computation: Trace) -> bool:
    return not torch.is_grad_enabled() or not any(
        getattr(p, "requires_grad", False) for p in computation.params) or \
        every_op_without_grad(computation)


def every_op_without_grad(computation: Trace) -> bool:
    """Whether the program switches grad mode off before its first operation and leaves it off
    until its last (an optimizer's step runs under ``torch.no_grad``): autograd then records
    none of its writes either."""
    grad = torch.is_grad_enabled()
    for b in computation.bound_symbols:
        if b.symbol is glue.SET_GLOBAL_STATE:
            grad = dict(b.args[0]).get(0, grad)  # index 0: grad mode (capture/ambient.py)
        elif grad and not (isinstance(b.symbol, glue.Glue) or COPY_OF_WRITTEN_INPUT in b.tags):
            return False
    return True


@trace_step
def reinplace(computation: Trace, epilogue: Trace) -> tuple[Trace, Trace]:
    direct: set[str] = set()
    lines = []
    for b in computation.bound_symbols:
        if COPY_OF_WRITTEN_INPUT in b.tags:
            direct.add(b.outputs.name)
            b = glue.ALIAS.bind(*b.args, outputs=b.outputs, source=b.source, tags=b.tags)
        lines.append(b)
    if not direct:
        return computation, epilogue
    epilogue_lines = [b for b in epilogue.bound_symbols
                      if not (b.symbol is glue.COPY_BACK and b.args[1].name in direct)]
    return (computation.derive(lines, "Reinplace"), epilogue.derive(epilogue_lines, "Reinplace"))
