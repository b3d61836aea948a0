"""The recompute policy: saved values the backward makes again instead of keeping them alive.

The split (``split.py``) asks two questions of every value the backward needs from the forward:
- Is it a view (``t(weight)``, ``view``) of values the forward names anyway? Then recomputing it in
  the backward is free, and the torch-level op that made it (``linear``) need not run as its ATen
  ops just to hand the view over.
- Did a cheap pointwise op (``torch.Tag.pointwise``) make it from values that are saved anyway?
  Then it is recomputed at the start of the backward instead of kept alive.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..core.symbols import BoundSymbol, TorchSymbol


def _keep(x):
    return x


def _trace_args(call, namer, number):
    """A recorded call's arguments for a trace line: fakes by name, symbolic sizes by ``number``."""
    def value(x):
        if isinstance(x, torch.Tensor):
            return namer.proxies[namer.name_of[id(x)]]
        return number(x) if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else x
    return pytree.tree_map(value, (call.args, call.kwargs))


def recompute_views_in_backward(saved: list[str], joint, namer, torch_level: set[int],
                                number=_keep):
    """A saved value that is a view (``t(weight)``, ``view``) of values the forward names anyway
    is recomputed in the backward, for free: the torch-level op that made it (``linear``) then
    need not run as its ATen ops just to hand the view over."""
    producer = {}
    for call in joint.forward_calls:
        for t in pytree.tree_leaves(call.out):
            if isinstance(t, torch.Tensor):
                producer.setdefault(id(t), call)
    saved = list(saved)
    lines: list[BoundSymbol] = []
    for name in list(saved):
        fake = namer.fakes[name]
        call = producer.get(id(fake))
        if (call is None or id(fake) in torch_level or not getattr(call.func, "is_view", False)
                or not isinstance(call.out, torch.Tensor)):
            continue
        reads = [x for x in pytree.tree_leaves((call.args, call.kwargs))
                 if isinstance(x, torch.Tensor)]
        if not all(id(x) in torch_level for x in reads):
            continue
        saved.remove(name)
        for x in reads:
            if namer.name_of[id(x)] not in saved:
                saved.append(namer.name_of[id(x)])
        args, kwargs = _trace_args(call, namer, number)
        lines.append(BoundSymbol(TorchSymbol(call.func, f"torch.ops.{call.func}", "function"),
                                 tuple(args), dict(kwargs), namer.proxies[name],
                                 comment="a view, recomputed rather than saved"))
    return saved, lines


def _is_cheap_pointwise(func) -> bool:
    return torch.Tag.pointwise in getattr(func, "tags", ()) and not func._schema.is_mutable


def recompute_in_backward(saved: list[str], joint, namer, parent_of, lowered, number=_keep):
    """Move saved values that a cheap pointwise op makes from already-saved values (or forward
    inputs) into the backward; returns the new saved list and the lines to recompute them."""
    producer = {}
    for call in joint.forward_calls:
        for t in pytree.tree_leaves(call.out):
            if isinstance(t, torch.Tensor):
                producer.setdefault(id(t), call)
    # Memory some forward op writes in place: recomputing from it would read other values.
    written = set()
    for call in joint.forward_calls:
        if call.func._schema.is_mutable:
            for x in pytree.tree_leaves((call.args, call.kwargs)):
                if isinstance(x, torch.Tensor):
                    written.add(x.untyped_storage()._cdata)
    saved = list(saved)
    lines: list[BoundSymbol] = []
    changed = True
    while changed:
        changed = False
        for name in list(saved):
            fake = namer.fakes[name]
            call = producer.get(id(fake))
            if call is None or not _is_cheap_pointwise(call.func) or \
                    not isinstance(call.out, torch.Tensor):
                continue
            if fake.untyped_storage()._cdata in written:
                continue
            reads = [x for x in pytree.tree_leaves((call.args, call.kwargs))
                     if isinstance(x, torch.Tensor)]
            if any(x.untyped_storage()._cdata in written for x in reads):
                continue  # what it reads is overwritten later in the forward
            read_names = [namer.name_of.get(id(x)) for x in reads]
            # Only when it saves memory: every value it reads is saved anyway. (Not an input
            # that is not saved: the caller may change it in place before the backward, which
            # eager, having saved only the result, allows.)
            if None in read_names or not all(n in saved for n in read_names):
                continue
            saved.remove(name)
            args, kwargs = _trace_args(call, namer, number)
            lines.insert(0, BoundSymbol(TorchSymbol(call.func, f"torch.ops.{call.func}",
                                                    "function"), tuple(args), dict(kwargs),
                                        namer.proxies[name],
                                        comment="recomputed rather than saved"))
            changed = True
    return saved, _ordered(lines, namer)


def _ordered(lines, namer):
    """Recomputations in dependency order."""
    done, result = set(), []
    pending = list(lines)
    while pending:
        for b in pending:
            needs = {p.name for p in b.input_proxies()}
            defined_here = {x.outputs.name for x in pending}
            if not (needs & (defined_here - done)):
                result.append(b)
                done.add(b.outputs.name)
                pending.remove(b)
                break
        else:
            result.extend(pending)
            break
    return result
