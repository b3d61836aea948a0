"""Common-subexpression elimination: a line that repeats an earlier one reuses its results.

Never merged: random ops, lines that write, lines reading or producing tensors whose memory
some line of the trace writes to (the same expression may then read different values), and two
lines whose results are both returned (eager returns two objects: writing to one must not change
the other), and lines under different grad modes or autocast states (``x.t()`` under ``no_grad``
is detached; the same expression outside it is not). Constants are compared exactly: ``-0.0`` is
not ``0.0``, and ``nan`` is ``nan``.

Nor are lines that round a value that requires grad to a narrower floating dtype
(``t.to(torch.bfloat16)``): autograd rounds each such line's incoming gradient on its own, and
eager's sum of three rounded gradients is not the rounding of their sum (fuzzer 53:1341).

A backward trace passes ``distinct_outputs=False``: the gradients it returns go to autograd, which
copies a gradient handed to two parameters, while two views of one result would both be kept as
``.grad`` and then accumulate into each other.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..core import glue
from ..core.proxies import Proxy, TensorProxy
from ..core.symbols import BoundSymbol, TorchSymbol
from ..core.effects import may_merge
from ..core.tags import MUTATION
from ..core.trace import Trace
from ..core.runner import trace_pass


def _key(value):
    if type(value) is float:  # 0.0 == -0.0 but x * 0.0 is not x * -0.0; nan != nan
        return ("float", value.hex())
    if type(value) is complex:
        return ("complex", value.real.hex(), value.imag.hex())
    if isinstance(value, Proxy):
        return ("proxy", value.name)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, _key(v)) for k, v in value.items())
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value).__name__, value)


@trace_pass("Common Subexpression Elimination")
def common_subexpression_elimination(trace: Trace,
                                     distinct_outputs: bool = True) -> list[BoundSymbol]:
    written = {p.storage for b in trace.bound_symbols if MUTATION in b.tags
               for p in b.input_proxies() if isinstance(p, TensorProxy)}
    seen: dict = {}
    renames: dict[str, Proxy] = {}
    returned = _returned_names(trace) if distinct_outputs else set()
    switched: dict = {}  # the global state switches in force (index in global_state() -> value)
    result = []
    for bsym in trace.bound_symbols:
        if renames:
            bsym = bsym.substitute(renames)
        if bsym.symbol is glue.SET_GLOBAL_STATE:
            switched.update(bsym.args[0])
        mergeable = (isinstance(bsym.symbol, TorchSymbol) and may_merge(bsym)
                     and not any(isinstance(p, TensorProxy) and p.storage in written
                                 for p in bsym.input_proxies() + bsym.output_proxies())
                     and not _narrows_a_gradient(bsym))
        if mergeable:
            key = (id(bsym.symbol.fn), bsym.symbol.name, bsym.symbol.style,
                   _key(bsym.args), _key(bsym.kwargs), tuple(sorted(switched.items())))
            earlier = seen.get(key)
            if earlier is not None and not (_returns_any(bsym, returned)
                                            and _returns_any(earlier, returned)):
                for mine, theirs in zip(pytree.tree_leaves(bsym.outputs),
                                        pytree.tree_leaves(earlier.outputs)):
                    if isinstance(mine, Proxy):
                        renames[mine.name] = theirs
                continue
            seen.setdefault(key, bsym)
        result.append(bsym)
    return result


def _narrows_a_gradient(bsym) -> bool:
    """Whether the line rounds a tensor that requires grad to a floating dtype with fewer bits."""
    outputs = [p for p in bsym.output_proxies() if isinstance(p, TensorProxy)]
    for x in bsym.input_proxies():
        if isinstance(x, TensorProxy) and x.requires_grad and x.dtype.is_floating_point:
            bits = torch.finfo(x.dtype).bits
            if any(o.dtype.is_floating_point and torch.finfo(o.dtype).bits < bits
                   for o in outputs):
                return True
    return False


def _returned_names(trace: Trace) -> set[str]:
    """The names the trace's last line (its return) hands out."""
    last = trace.bound_symbols[-1] if trace.bound_symbols else None
    if last is None or last.symbol not in glue.RETURNS:
        return set()
    return {p.name for p in last.input_proxies()}


def _returns_any(bsym, returned: set[str]) -> bool:
    return any(p.name in returned for p in bsym.output_proxies())
