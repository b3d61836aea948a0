"""The python executor's fusion of prologue tensor checks into one C++ call.

The readable prologue checks each tensor on its own line (``check_tensor(x, shape, ...)``). This
pass replaces all of them with a single ``torch._C._dynamo.guards.TensorGuards.check`` call, which
checks type, dtype, device, shape, stride, requires_grad and dispatch keys of every tensor in C++;
on failure it returns ``check_verbose``'s sentence naming the tensor and what differed.
"""
from __future__ import annotations

import time

from torch._C._dynamo.guards import TensorGuards

from ..core.symbols import BoundSymbol, GlueSymbol
from ..core.trace import Trace


def _fused_formatter(bsym, w):
    guards = w.constant(bsym.info["guards"], "tensor_guards")
    names = w.constant(bsym.info["names"], "tensor_names")
    tensors = ", ".join(p.name for p in bsym.args)
    return [f"if not {guards}.check({tensors}):",
            f"  return {guards}.check_verbose({tensors}, tensor_check_names={names})"
            f"  # {len(bsym.args)} tensors checked in one call"]


CHECK_TENSORS = GlueSymbol("check_tensors", _fused_formatter)


def fuse_tensor_checks(trace: Trace) -> Trace:
    start = time.perf_counter()
    checks = [b for b in trace.bound_symbols if b.symbol.name == "check_tensor"]
    if not checks:
        return trace.derive(list(trace.bound_symbols), "Fuse Tensor Checks (none)", 0.0)
    reals = [b.info["real"] for b in checks]
    guards = TensorGuards(*reals, dynamic_dims_sizes=[list(t.shape) for t in reals],
                          dynamic_dims_strides=[list(t.stride()) for t in reals])
    fused = BoundSymbol(CHECK_TENSORS, tuple(b.args[0] for b in checks), executor="python",
                        info={"guards": guards, "names": [b.info["path"] for b in checks]})
    last = checks[-1]
    lines = []
    for b in trace.bound_symbols:
        if b is last:
            lines.append(fused)
        elif b.symbol.name != "check_tensor":
            lines.append(b)
    return trace.derive(lines, "Fuse Tensor Checks (python executor)", time.perf_counter() - start)
