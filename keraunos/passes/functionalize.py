"""Functionalize writes: a chain of pointwise in-place writes of one tensor becomes out-of-place
values and one write of the last value, so that a fused region may hold the whole chain.

A region may write a memory once (``executors/fusion/regions.py``: Inductor compiles some
repeated writes of one memory wrongly), and an optimizer's step writes each state tensor and
parameter two or three times (``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=...)``). Here

    exp_avg_sq.mul_(0.999)
    exp_avg_sq.addcmul_(grad, grad, value=0.001)
    t6 = exp_avg_sq.sqrt()

becomes

    exp_avg_sq_v1 = exp_avg_sq.mul(0.999)
    exp_avg_sq_v2 = exp_avg_sq_v1.addcmul(grad, grad, value=0.001)
    exp_avg_sq.copy_(exp_avg_sq_v2)
    t6 = exp_avg_sq_v2.sqrt()

which computes the same values: each value is the write's result, later lines read the last
one, and the memory is written once, where the last write was. Only where that is exactly so:
the tensor's memory has no other name in the trace (no view of it; an input's ``x_updated = x``
alias is the same tensor under its written name, the other name unread after it), the writes
are pointwise ATen ops of one dtype on a floating-point tensor of fixed sizes, and they run where
autograd records nothing (grad mode off in the trace, or no tensor of theirs requires grad).
Used by the fused tier only (``pipeline.functionalize_for_fusion``): the torch tier's in-place
kernels are the fastest way to run them one by one.
"""
from __future__ import annotations

import torch

from ..core import glue, tree
from ..core.proxies import TensorProxy
from ..core.runner import trace_pass
from ..core.symbols import BoundSymbol, TorchSymbol
from ..core.tags import MUTATION
from ..torch_internals.dispatch import OpOverloadPacket


def _out_of_place(bsym: BoundSymbol):
    """The out-of-place method of a pointwise in-place method line (``mul`` for ``x.mul_(...)``)."""
    symbol = bsym.symbol
    if not isinstance(symbol, TorchSymbol) or symbol.style != "method":
        return None
    name = symbol.name
    if not name.endswith("_") or name.endswith("__") or name in ("copy_", "zero_", "fill_"):
        return None
    base = name[:-1]
    packet = getattr(torch.ops.aten, base, None)
    method = getattr(torch.Tensor, base, None)
    if packet is None or method is None or not isinstance(packet, OpOverloadPacket):
        return None
    if not any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()):
        return None
    return TorchSymbol(method, base, "method")


def _names_by_storage(lines) -> dict[int, set[str]]:
    """For each storage, the names of the tensors in it."""
    names: dict[int, set[str]] = {}
    for b in lines:
        for p in (*b.input_proxies(), *b.output_proxies()):
            if isinstance(p, TensorProxy) and p.storage is not None:
                names.setdefault(p.storage, set()).add(p.name)
    return names


def _grad_mode_by_line(lines) -> list[bool]:
    now, modes = torch.is_grad_enabled(), []
    for b in lines:
        if b.symbol is glue.SET_GLOBAL_STATE:
            now = dict(b.args[0]).get(0, now)  # index 0: grad mode (capture/ambient.py)
        modes.append(now)
    return modes


def _candidate(bsym: BoundSymbol, grad_on: bool, names: dict[int, set[str]], aliases: dict,
               last_use: dict[str, int], index: int):
    """The written tensor when this line's write may become a value, else None."""
    if _out_of_place(bsym) is None or not bsym.args:
        return None
    w = bsym.args[0]
    if not isinstance(w, TensorProxy) or not w.dtype.is_floating_point or w.storage is None:
        return None
    if not all(type(n) is int for n in (*w.shape, *w.stride)) or w.stride != _contiguous(w.shape):
        return None  # (an out-of-place value of another layout would not have w's strides)
    tensors = [p for p in bsym.input_proxies() if isinstance(p, TensorProxy)]
    factor = _scalar_factor(bsym)  # (a float32 one of a bfloat16 tensor: spelled out in float32)
    if any((t.dtype != w.dtype and not (t is factor and w.dtype in _REDUCED
                                        and t.dtype == torch.float32))
           or t.device != w.device for t in tensors):
        return None
    if grad_on and any(t.requires_grad for t in tensors):
        return None
    others = names.get(w.storage, set()) - {w.name}
    source = aliases.get(w.name)
    if others - {source} or (source is not None and last_use.get(source, -1) > index):
        return None
    if any(p.storage == w.storage for p in tensors if p.name != w.name):
        return None
    return w


@trace_pass("Functionalize Writes")
def functionalize_writes(trace):
    lines = list(trace.bound_symbols)
    names = _names_by_storage(lines)
    aliases = {b.outputs.name: b.args[0].name for b in lines if b.symbol is glue.ALIAS}
    last_use: dict[str, int] = {}
    for i, b in enumerate(lines):
        for p in b.input_proxies():
            last_use[p.name] = i
    modes = _grad_mode_by_line(lines)
    # Which lines write which tensor as a value; the chain ends at the tensor's last write.
    chains: dict[str, list[int]] = {}
    storage_of: dict[str, int] = {}
    refused: set[int] = set()  # storages some line may write another way: left as they are
    for i, b in enumerate(lines):
        w = _candidate(b, modes[i], names, aliases, last_use, i)
        if w is not None:
            chains.setdefault(w.name, []).append(i)
            storage_of[w.name] = w.storage
        elif MUTATION in b.tags or getattr(b.symbol, "name", "").endswith("_"):
            refused |= {p.storage for p in _may_write(b) if isinstance(p, TensorProxy)}
    # One write alone is left in place (a region may hold it), unless its scalar factor is a
    # tensor, which a region can take only spelled out.
    chains = {n: c for n, c in chains.items() if storage_of[n] not in refused and (
        len(c) > 1 or _tensor_scalar_factor(lines[c[0]]))}
    if not chains:
        return lines
    taken = {p.name for b in lines for p in (*b.input_proxies(), *b.output_proxies())}
    current: dict[str, TensorProxy] = {}  # written name -> the proxy of its latest value
    ends = {c[-1]: n for n, c in chains.items()}
    starts = {i for c in chains.values() for i in c}
    out = []
    for i, b in enumerate(lines):
        if b.symbol is glue.RETURN or b.symbol in glue.RETURNS:
            out.append(b)  # returns the written memory itself, which holds the last value
            continue
        b = b.substitute(current) if current else b
        if i not in starts:
            out.append(b)
            continue
        w = lines[i].args[0]
        k = 1
        while f"{w.name}_v{k}" in taken:
            k += 1
        value = _proxy_like(w, f"{w.name}_v{k}")
        taken.add(value.name)
        written = b.replace(symbol=_out_of_place(b), outputs=value, subsymbols=[],
                            tags=set(b.tags) - {MUTATION})
        out += _with_tensor_scalar_spelled_out(written, taken)
        current[w.name] = value
        if ends.get(i) == w.name:
            out.append(BoundSymbol(TorchSymbol(torch.Tensor.copy_, "copy_", "method"),
                                   (w, value), {}, (), source=b.source, tags={MUTATION},
                                   module_stack=b.module_stack))
    return out


# Methods whose scalar factor (``value=``, ``alpha=``) may be a 0-dim tensor, as the pointwise
# ops they are, in the order eager's kernels compute them: ``x.addcdiv(a, b, value=t)`` is
# ``x + t * a / b``, ``x.addcmul(a, b, value=t)`` is ``x + t * a * b``, ``x.add(a, alpha=t)`` is
# ``x + t * a``. A region cannot take the tensor as a scalar (Inductor would read it with
# ``.item()``); as ops, it fuses. Each entry: the factor's keyword, the op that takes the second
# operand (if any), the op that ends it.
_SPELLED_OUT = {"addcdiv": ("value", torch.Tensor.div, "div", torch.Tensor.add, "add"),
                "addcmul": ("value", torch.Tensor.mul, "mul", torch.Tensor.add, "add"),
                "add": ("alpha", None, None, torch.Tensor.add, "add"),
                "sub": ("alpha", None, None, torch.Tensor.sub, "sub")}
# Eager's kernels compute a bfloat16 or float16 tensor's ops in float32 and round once: such a
# tensor's ops are spelled out so, with a factor of its dtype or float32 (AdamW's step size, of
# bfloat16 parameters).
_REDUCED = (torch.bfloat16, torch.float16)


def _scalar_factor(b: BoundSymbol) -> TensorProxy | None:
    """The 0-dim tensor a line of ``_SPELLED_OUT`` (or its in-place form) takes as its scalar
    factor, if it takes one."""
    spelled = _SPELLED_OUT.get(getattr(b.symbol, "name", "").rstrip("_"))
    factor = b.kwargs.get(spelled[0]) if spelled is not None else None
    return factor if isinstance(factor, TensorProxy) and factor.shape == () else None


def _tensor_scalar_factor(b: BoundSymbol) -> bool:
    return _scalar_factor(b) is not None


def _with_tensor_scalar_spelled_out(b: BoundSymbol, taken: set[str]) -> list[BoundSymbol]:
    """``b``, or the lines it is when its scalar factor is a 0-dim tensor of its dtype (or a
    float32 one of a bfloat16 or float16 tensor), computed as eager's kernel computes it."""
    spelled = _SPELLED_OUT.get(b.symbol.name)
    if spelled is None:
        return [b]
    key, combine, combine_name, finish, finish_name = spelled
    factor = b.kwargs.get(key)
    operands = b.args[1:]
    x = b.args[0]
    if not isinstance(factor, TensorProxy) or factor.shape != () or set(b.kwargs) != {key} \
            or len(operands) != (2 if combine else 1) or not all(
            isinstance(o, TensorProxy) and o.shape == x.shape and o.dtype == x.dtype
            for o in operands):
        return [b]
    reduced = x.dtype in _REDUCED and factor.dtype in (torch.float32, x.dtype)
    if factor.dtype != x.dtype and not reduced:
        return [b]
    compute = torch.float32 if reduced else x.dtype
    lines: list[BoundSymbol] = []

    def line(fn, name, args, hint):
        out = _proxy_like(x, _fresh(f"{b.outputs.name}_{hint}", taken), compute)
        lines.append(b.replace(symbol=TorchSymbol(fn, name, "method"), args=args, kwargs={},
                               outputs=out))
        return out

    def computed(t):
        return t if t.dtype == compute else line(torch.Tensor.to, "to", (t, compute), "f")
    term = line(torch.Tensor.mul, "mul", (computed(operands[0]), factor), "s")
    if combine is not None:
        term = line(combine, combine_name, (term, computed(operands[1])), "q")
    if not reduced:
        lines.append(b.replace(symbol=TorchSymbol(finish, finish_name, "method"),
                               args=(x, term), kwargs={}))
        return lines
    total = line(finish, finish_name, (computed(x), term), "r")
    lines.append(b.replace(symbol=TorchSymbol(torch.Tensor.to, "to", "method"),
                           args=(total, x.dtype), kwargs={}))
    return lines


def _fresh(hint: str, taken: set[str]) -> str:
    k = 1
    while f"{hint}_{k}" in taken:
        k += 1
    taken.add(f"{hint}_{k}")
    return f"{hint}_{k}"


def _may_write(b: BoundSymbol) -> list:
    """The tensors a writing line may write: ``out=``, an in-place method's own tensor, or, for
    any other line that writes (an opaque call), every tensor it reads."""
    if "out" in b.kwargs:
        return list(tree.leaves(b.kwargs["out"]))
    name = getattr(b.symbol, "name", "")
    if isinstance(b.symbol, TorchSymbol) and b.symbol.style == "method" and \
            name.endswith("_") and not name.endswith("__") and b.args:
        return [b.args[0]]
    return b.input_proxies()


def _contiguous(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _proxy_like(w: TensorProxy, name: str, dtype: torch.dtype | None = None) -> TensorProxy:
    """A new tensor with ``w``'s metadata (another ``dtype`` if given) in memory of its own."""
    memory = torch.empty_strided(w.shape, w.stride, dtype=dtype or w.dtype, device="meta")
    proxy = TensorProxy(name, memory)
    proxy.device = w.device
    proxy.requires_grad = False
    return proxy
