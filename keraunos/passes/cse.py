"""Common-subexpression elimination: a line that repeats an earlier one reuses its results.

Never merged: random ops, lines that write, and lines reading or producing tensors whose memory
some line of the trace writes to (the same expression may then read different values).
"""
from __future__ import annotations

import time

from torch.utils import _pytree as pytree

from ..core.proxies import Proxy, TensorProxy
from ..core.symbols import TorchSymbol
from ..core.tags import MUTATION, RANDOM
from ..core.trace import Trace


def _key(value):
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


def common_subexpression_elimination(trace: Trace) -> Trace:
    start = time.perf_counter()
    written = {p.storage for b in trace.bound_symbols if MUTATION in b.tags
               for p in b.input_proxies() if isinstance(p, TensorProxy)}
    seen: dict = {}
    renames: dict[str, Proxy] = {}
    result = []
    for bsym in trace.bound_symbols:
        if renames:
            bsym = bsym.substitute(renames)
        mergeable = (isinstance(bsym.symbol, TorchSymbol) and not bsym.tags & {MUTATION, RANDOM}
                     and not any(isinstance(p, TensorProxy) and p.storage in written
                                 for p in bsym.input_proxies() + bsym.output_proxies()))
        if mergeable:
            key = (id(bsym.symbol.fn), bsym.symbol.name, bsym.symbol.style,
                   _key(bsym.args), _key(bsym.kwargs))
            earlier = seen.get(key)
            if earlier is not None:
                for mine, theirs in zip(pytree.tree_leaves(bsym.outputs),
                                        pytree.tree_leaves(earlier.outputs)):
                    if isinstance(mine, Proxy):
                        renames[mine.name] = theirs
                continue
            seen[key] = bsym
        result.append(bsym)
    return trace.derive(result, "Common Subexpression Elimination", time.perf_counter() - start)
