"""Dead-code elimination: drop lines whose results nobody uses.

Lines whose effects forbid it (``effects.may_drop``: in-place writes, grad-mode switches, random
draws, which later random values depend on) are kept whatever their use.
"""
from __future__ import annotations

from ..core.proxies import TensorProxy
from ..core.glue import Glue
from ..core.symbols import BoundSymbol
from ..core.effects import may_drop
from ..core.tags import MUTATION
from ..core.trace import Trace
from ..core.runner import trace_pass



@trace_pass("Dead Code Elimination")
def dead_code_elimination(trace: Trace) -> list[BoundSymbol]:
    refreshing = _refreshing_reads(trace.bound_symbols)
    live: set[str] = set()
    written_later: set[str] = set()  # tensors that kept in-place lines further down write
    kept = []
    for index in range(len(trace.bound_symbols) - 1, -1, -1):
        bsym = trace.bound_symbols[index]
        new_outputs = [p.name for p in bsym.output_proxies()]
        needed = (not may_drop(bsym) or isinstance(bsym.symbol, Glue) and not new_outputs
                  or any(name in live for name in new_outputs)
                  or bool(refreshing.get(index, set()) & written_later))
        if needed:
            kept.append(bsym)
            live.update(p.name for p in bsym.input_proxies())
            if MUTATION in bsym.tags and bsym.args and isinstance(bsym.args[0], TensorProxy):
                written_later.add(bsym.args[0].name)
    kept.reverse()
    return kept


def _refreshing_reads(bsyms) -> dict[int, set[str]]:
    """Lines that read a tensor after its memory was written in place (through it or another
    view, `a[1:] = w`): index -> the names read. Autograd refreshes a view's history when an op
    reads it; an in-place write to a view whose memory was written through another view, with no
    read in between, raises "a leaf Variable that requires grad is being used in an in-place
    operation" (eager, with the read, does not). Such a read is kept when the tensor it reads is
    written in place later."""
    writers: dict[object, set[str]] = {}  # storage -> names written in place so far
    reads: dict[int, set[str]] = {}
    for index, bsym in enumerate(bsyms):
        if MUTATION in bsym.tags:
            if bsym.args and isinstance(bsym.args[0], TensorProxy):
                target = bsym.args[0]
                writers.setdefault(target.storage, set()).add(target.name)
            continue
        names = {p.name for p in bsym.input_proxies() if isinstance(p, TensorProxy)
                 and p.storage in writers}
        if names:
            reads[index] = names
    return reads

