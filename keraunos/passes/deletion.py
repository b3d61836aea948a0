"""Free intermediates early: ``del`` each name right after the line that last uses it."""
from __future__ import annotations

from ..core.proxies import Proxy
from ..core.symbols import BoundSymbol, GlueSymbol
from ..core.trace import Trace
from .runner import trace_pass


def _del_formatter(bsym, w):
    return [f"del {', '.join(bsym.args)}"]


DELETE = GlueSymbol("del", _del_formatter)


@trace_pass("Delete Last Used")
def delete_last_used(trace: Trace) -> list[BoundSymbol]:
    params = {p.name for p in trace.params if isinstance(p, Proxy)}
    seen: set[str] = set()
    result: list[BoundSymbol] = []
    last = trace.bound_symbols[-1] if trace.bound_symbols else None
    for bsym in reversed(trace.bound_symbols):
        used = [p.name for p in bsym.input_proxies()]
        if bsym is not last:
            dead = []
            for name in [p.name for p in bsym.output_proxies()] + used:
                if name not in seen and name not in params and name not in dead:
                    dead.append(name)
            if dead:
                result.append(BoundSymbol(DELETE, tuple(dead)))
        seen.update(used)
        result.append(bsym)
    result.reverse()
    return result
