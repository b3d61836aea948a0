"""Free intermediates early: ``del`` each name right after the line that last uses it (a fused
region's inputs: handed over to it, see ``glue.HandOver``). A trace whose function takes its
inputs boxed (a backward's saved tensors, ``Trace.python_callable(boxed=True)``) deletes its
tensor parameters too."""
from __future__ import annotations

from ..core import glue
from ..core.proxies import Proxy, TensorProxy
from ..core.symbols import BoundSymbol
from ..core.trace import Trace
from ..core.runner import trace_pass


@trace_pass("Delete Last Used")
def delete_last_used(trace: Trace, params_too: bool = False) -> list[BoundSymbol]:
    # (A size symbol may be read inside a symbolic expression that names no proxy: kept.)
    params = {p.name for p in trace.params if isinstance(p, Proxy)
              and not (params_too and isinstance(p, TensorProxy))}
    seen: set[str] = set()
    result: list[BoundSymbol] = []
    last = trace.bound_symbols[-1] if trace.bound_symbols else None
    for bsym in reversed(trace.bound_symbols):
        used = bsym.input_proxies()
        if bsym is not last:
            dead: dict[str, Proxy] = {}
            for p in bsym.output_proxies() + used:
                if p.name not in seen and p.name not in params:
                    dead.setdefault(p.name, p)
            handed = [n for n in dict.fromkeys(p.name for p in used) if n in dead] \
                if hasattr(getattr(bsym.symbol, "call", None), "take") else []
            for name in handed:
                del dead[name]
            if dead:
                result.append(glue.DELETE.bind(*dead.values()))
            if handed:
                bsym = bsym.replace(fields=glue.HandOver(tuple(handed)))
        seen.update(p.name for p in used)
        result.append(bsym)
    result.reverse()
    return result
