"""Peephole: lines of the backward that hand on their input's data unchanged are read past.

PyTorch's derivative formulas, replayed op by op, leave chains that change nothing: the mm
formulas give ``t(t(w))`` (the forward's ``w.t()``, recomputed, transposed back), saved tensors
come through ``detach(detach(x))``, and the derivative of ``x ** 2`` computes ``x ** 1.0``. Eager
runs them in C++ and they cost little there; a Python backward pays a call for each (in a
2-layer Llama's backward, 80 of 340 ops).

A line ``y = chain(x)`` is *read past* when ``y`` has exactly ``x``'s data and layout:
- a chain of aliasing views (``t``, ``transpose``, ``permute``, ``view``, ``_unsafe_view``,
  ``expand``, ``squeeze``, ``unsqueeze``, ``detach``, ``alias``) from ``x`` whose end has ``x``'s
  sizes, strides and dtype: the same memory read the same way (none of these ops moves the
  storage offset);
- ``pow(x, 1)``, a copy with ``x``'s values (``x ** 1`` is ``x`` exactly in IEEE arithmetic, and
  ATen copies for it) in ``x``'s layout, when nothing in the trace writes in place (the copy
  would keep the old values).

Where ``y`` is read by an op that returns fresh tensors (``mm``, ``mul``; no output aliases an
input, no input is written) or by another chain op (whose output is a new tensor object either
way), it reads ``x`` instead. Those reads see the same values with the same strides, so results
are bit-identical. Where ``y`` is returned as a gradient, ``x`` is returned instead when ``x``
is a tensor this trace made: the gradient holds the same values in the same memory. Every other
read keeps ``y``. Chain lines left unread are dropped.
"""
from __future__ import annotations

import functools

import torch

from ..core import glue
from ..core.proxies import TensorProxy
from ..core.symbols import BoundSymbol
from ..core.effects import may_drop, may_merge
from ..core.tags import MUTATION
from ..core.trace import Trace
from ..core.runner import trace_pass
from ..torch_internals.dispatch import OpOverload, has_kernel_for_dispatch_key

_aten = torch.ops.aten

# Ops whose output aliases their first argument's memory at the same storage offset.
ALIASING_CHAIN_OPS = frozenset({
    _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default,
    _aten._unsafe_view.default, _aten.expand.default, _aten.squeeze.dim, _aten.squeeze.dims,
    _aten.squeeze.default, _aten.unsqueeze.default, _aten.detach.default, _aten.alias.default,
})


@trace_pass("Peephole (no-op chains)")
def read_past_noop_chains(trace: Trace) -> list[BoundSymbol]:
    lines = list(trace.bound_symbols)
    same = _same_data(lines, copies_allowed=not any(_writes(b) for b in lines))
    if not same:
        return lines
    lines = [_read_past(b, same) if _fresh_outputs(b) or _op(b) in ALIASING_CHAIN_OPS else b
             for b in lines]
    if lines and lines[-1].symbol is glue.RETURN_GRADIENTS:
        lines[-1] = _returned_past(lines[-1], same, lines[:-1])
    return _without_unread_chains(lines)


def _op(bsym: BoundSymbol):
    """The ATen overload a line calls, or None (glue lines, torch-level calls)."""
    fn = getattr(bsym.symbol, "fn", None)
    return fn if isinstance(fn, OpOverload) else None


def _same_data(lines: list[BoundSymbol], copies_allowed: bool) -> dict[str, TensorProxy]:
    """Name of a chain's end -> the tensor whose data and layout it has."""
    # A chain op's output -> the tensors it is an alias of, from the chain's start on.
    aliased: dict[str, list[TensorProxy]] = {}
    same: dict[str, TensorProxy] = {}
    for b in lines:
        op = _op(b)
        if op is None or not may_merge(b) or not b.args:
            continue
        source, out = b.args[0], b.outputs
        if not (isinstance(source, TensorProxy) and isinstance(out, TensorProxy)):
            continue
        if op in ALIASING_CHAIN_OPS:
            chain = aliased[out.name] = [*aliased.get(source.name, ()), source]
            # The earliest with the same layout: view(view(x, a), b) may end where x, or
            # only where view(x, a), started.
            start = next((p for p in chain if _same_layout(out, p)), None)
            if start is not None:
                same[out.name] = same.get(start.name, start)
        elif copies_allowed and op is _aten.pow.Tensor_Scalar and _is_one(b.args[1]):
            start = same.get(source.name, source)
            if _same_layout(out, start):
                same[out.name] = start
    return same


def _is_one(exponent) -> bool:
    return type(exponent) in (int, float) and exponent == 1


def _same_layout(a: TensorProxy, b: TensorProxy) -> bool:
    """Same sizes, strides and dtype, all known numbers (symbolic sizes are left alone)."""
    sizes = (*a.shape, *a.stride, *b.shape, *b.stride)
    return (all(type(s) is int for s in sizes) and a.shape == b.shape and a.stride == b.stride
            and a.dtype == b.dtype and a.device == b.device)


def _writes(bsym: BoundSymbol) -> bool:
    op = _op(bsym)
    if MUTATION in bsym.tags:
        return True
    if op is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _fresh_outputs(bsym: BoundSymbol) -> bool:
    """The line's op makes new tensors: no output aliases an input, no input is written."""
    op = _op(bsym)
    return op is not None and not _writes(bsym) and _returns_fresh(op)


@functools.lru_cache(maxsize=None)
def _returns_fresh(op) -> bool:
    """What the schema says, for ops with kernels of their own. A composite's schema may omit
    that it returns its input (``atleast_1d``, ``type_as`` return ``self`` when nothing changes);
    a backward replayed from autograd's graph has them decomposed anyway."""
    returns = op._schema.returns
    if not returns or any(r.alias_info is not None for r in returns):
        return False
    return not has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _read_past(bsym: BoundSymbol, same: dict[str, TensorProxy]) -> BoundSymbol:
    if not any(p.name in same for p in bsym.input_proxies()):
        return bsym
    return bsym.substitute(same)


def _returned_past(ret: BoundSymbol, same: dict[str, TensorProxy],
                   body: list[BoundSymbol]) -> BoundSymbol:
    """The backward's return line, returning a chain's start where that is a tensor the trace
    made: the same memory as before. Never an input (a saved tensor, an incoming gradient), which
    would become the very object of a ``.grad``. A start returned twice is one object returned
    twice, which autograd accumulates apart (it copies all but one); the views it replaces would
    have been kept as they are, sharing memory across two ``.grad``s."""
    made = {p.name for b in body for p in b.output_proxies()}
    mapping = {p.name: same[p.name] for p in ret.input_proxies()
               if p.name in same and same[p.name].name in made}
    return ret.substitute(mapping) if mapping else ret


def _without_unread_chains(lines: list[BoundSymbol]) -> list[BoundSymbol]:
    """Drop chain lines (pure: aliasing views, ``pow``) whose output nothing reads."""
    read: set[str] = set()
    kept = []
    for b in reversed(lines):
        op = _op(b)
        droppable = ((op in ALIASING_CHAIN_OPS or op is _aten.pow.Tensor_Scalar)
                     and may_drop(b))
        if droppable and not any(p.name in read for p in b.output_proxies()):
            continue
        kept.append(b)
        read.update(p.name for p in b.input_proxies())  # glue lines too: args hold reads
    kept.reverse()
    return kept


def peephole_stage(c) -> None:
    """The pass as a stage of ``pipeline.STAGES``, for a ``pipeline.Compilation`` ``c``: after
    ``autograd_split``, before the executor claims, so that the fusion regions see the backward
    it leaves. Both front ends get it (``keraunos.jit``, and the dynamo backend through it)."""
    if c.backward is None:
        return
    # Kept even when nothing changed, as every pass's trace is: the backward's history shows
    # that the pass ran.
    c.backwards.append(read_past_noop_chains(c.backward))
    c.time(read_past_noop_chains.label, c.backward.seconds)
