"""Dead-code elimination: drop lines whose results nobody uses.

Lines tagged ``MUTATION`` (in-place writes, grad-mode switches) or ``RANDOM`` (they advance the
generator, so later random values depend on them) are kept whatever their use.
"""
from __future__ import annotations

import time

from ..core.proxies import Proxy
from ..core.symbols import GlueSymbol
from ..core.tags import MUTATION, RANDOM
from ..core.trace import Trace

_KEEP = {MUTATION, RANDOM}


def dead_code_elimination(trace: Trace) -> Trace:
    start = time.perf_counter()
    live: set[str] = set()
    kept = []
    for bsym in reversed(trace.bound_symbols):
        new_outputs = [p.name for p in bsym.output_proxies()]
        needed = (bsym.tags & _KEEP or isinstance(bsym.symbol, GlueSymbol) and not new_outputs
                  or any(name in live for name in new_outputs))
        if needed:
            kept.append(bsym)
            live.update(p.name for p in bsym.input_proxies())
            live.update(_info_proxies(bsym))
    kept.reverse()
    return trace.derive(kept, "Dead Code Elimination", time.perf_counter() - start)


def _info_proxies(bsym) -> list[str]:
    return [v.name for v in bsym.info.values() if isinstance(v, Proxy)]
