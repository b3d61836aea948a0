"""A backward inside the program, expanded: the forward and backward it stands for, in line.

Capture records ``loss.backward()`` as one line (``capture/backward.py``):

    (g0, g1) = backward_in_program([loss], [t9], inputs=('weight', 'bias'))

This pass replaces it. The lines before it are a computation returning the line's outputs
(``loss``); the autograd split (``split.py``) makes that computation's forward (the same lines,
with an op run as its ATen ops where the backward needs a value made inside it) and its
backward (PyTorch's own derivative formulas, op by op). The forward takes the place of the
lines before, the backward follows with ``t9`` as the incoming gradient, and the lines after
read its gradients where they read ``g0`` and ``g1``. Several backwards (gradient accumulation
over micro-batches) are expanded one after the other, each from everything before it.

The result computes everything itself, so it runs with grad mode off throughout (autograd's
own recording would only be waste, and the optimizer's in-place updates of leaves that require
grad would be refused); the grad mode the program leaves is set at its end.
"""
from __future__ import annotations

import copy

import torch

from ..core import glue, tree
from ..core.proxies import Proxy, TensorProxy
from ..core.runner import trace_pass
from ..core.symbols import BoundSymbol
from ..core.tags import MUTATION
from ..core.trace import Trace
from ..capture.backward import backward_in_program, dense_layout, fresh_grad
from .split import split_forward_backward


def has_backward(trace: Trace) -> bool:
    return any(getattr(b.symbol, "fn", None) is backward_in_program for b in trace.bound_symbols)


@trace_pass("Backward in the program (expanded)")
def expand_backwards(computation: Trace) -> list[BoundSymbol]:
    lines = list(computation.bound_symbols)
    while True:
        at = next((i for i, b in enumerate(lines)
                   if getattr(b.symbol, "fn", None) is backward_in_program), None)
        if at is None:
            break
        lines = _expand(computation, lines, at)
    return _without_grad_mode(_kept_gradients(lines))


def _expand(computation: Trace, lines: list[BoundSymbol], at: int) -> list[BoundSymbol]:
    line = lines[at]
    outputs, grad_outputs = line.args
    # ``x.grad = None`` lines (zero_grad) touch no value autograd sees: they run first.
    releases = [b for b in lines[:at] if b.symbol is glue.RELEASE_GRAD]
    before = Trace("computation", computation.params,
                   [b for b in lines[:at] if b.symbol is not glue.RELEASE_GRAD]
                   + [glue.RETURN.bind(list(outputs))],
                   ["the program up to its backward"], dict(computation.namespace))
    split = split_forward_backward(before)
    if split.differentiable != list(range(len(outputs))):
        raise NotImplementedError("an output of the backward that autograd does not reach")
    backward = split.place_gradients(split.backward)
    *forward_lines, returned = split.forward.bound_symbols
    *backward_lines, gradients = backward.bound_symbols
    # Names the split made are fresh in the program before the backward, not after it.
    known = {p.name for p in computation.params if isinstance(p, Proxy)}
    for b in lines[:at]:
        known.update(p.name for p in b.output_proxies())
    taken = set(known)
    for b in lines:
        taken.update(p.name for p in b.output_proxies())
    renames: dict[str, Proxy] = {}
    n_grads = len(grad_outputs)
    incoming = backward.params[len(backward.params) - n_grads:]
    for p, g in zip(incoming, grad_outputs):
        renames[p.name] = g
    for b in forward_lines + backward_lines:
        for p in b.output_proxies():
            if p.name not in known and p.name not in renames:
                renames[p.name] = _renamed(p, taken)
    index = {p.name: i for i, p in enumerate(computation.params) if isinstance(p, Proxy)}
    returned_grads = gradients.args[0]
    gradient_of = {}
    for out, name in zip(tree.leaves(line.outputs), line.kwargs["inputs"]):
        g = returned_grads[index[name]] if name in index else None
        if g is None:
            raise NotImplementedError(f"no gradient of {name} in the split's backward")
        gradient_of[out.name] = renames.get(g.name, g)
    expanded = [_renamed_line(b, renames) for b in forward_lines + backward_lines]
    after = [_renamed_line(b, gradient_of) for b in lines[at + 1:]]
    return releases + expanded + after


def _kept_gradients(lines: list[BoundSymbol]) -> list[BoundSymbol]:
    """``t = fresh_grad(g, w)`` as ``g`` itself, where autograd's engine would keep ``g`` as
    ``w.grad`` too: ``g`` is memory the backward made (an ATen op's new tensor, or a view of
    one), nothing after the line reads that memory otherwise, and ``g`` is laid out as the
    engine lays ``.grad`` out. Otherwise the copy stays."""
    root: dict[str, str] = {}      # name -> the name of the new tensor whose memory it is
    made_new: set[str] = set()     # names of new tensors an ATen op made
    last_read: dict[str, int] = {}  # memory (root name) -> index of the last line reading it
    for i, b in enumerate(lines):
        fn = getattr(b.symbol, "fn", None)
        outs = b.output_proxies()
        reads = [p for p in b.input_proxies() if isinstance(p, TensorProxy)]
        for p in reads:
            last_read[root.get(p.name, p.name)] = i
        schema = getattr(fn, "_schema", None)
        if schema is None or not outs:
            continue
        aliases = schema.returns and schema.returns[0].alias_info is not None
        if aliases and reads:
            for p in outs:
                root[p.name] = root.get(reads[0].name, reads[0].name)
        elif not aliases and not schema.is_mutable:
            made_new.update(p.name for p in outs)
    renames: dict[str, Proxy] = {}
    kept: list[BoundSymbol] = []
    claimed: set[str] = set()
    for i, b in enumerate(lines):
        if getattr(b.symbol, "fn", None) is fresh_grad:
            g, like = b.args
            memory = root.get(g.name, g.name)
            if memory in made_new and memory not in claimed and \
                    last_read.get(memory, i) <= i and _laid_out_as_grad(g, like):
                claimed.add(memory)
                renames[b.outputs.name] = g
                continue
        kept.append(_renamed_line(b, renames) if renames else b)
    return kept


def _laid_out_as_grad(g: TensorProxy, like: TensorProxy) -> bool:
    if g.shape != like.shape or g.dtype != like.dtype:
        return False
    if dense_layout(like.shape, like.stride):
        return g.stride == like.stride
    return g.stride == _contiguous_strides(g.shape)


def _contiguous_strides(shape) -> tuple:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _renamed(p: Proxy, taken: set[str]) -> Proxy:
    n, base = 0, p.name.rstrip("0123456789") or "t"
    while f"{base}{n}" in taken:
        n += 1
    taken.add(f"{base}{n}")
    made = copy.copy(p)
    made.name = f"{base}{n}"
    return made


def _renamed_line(b: BoundSymbol, renames: dict[str, Proxy]) -> BoundSymbol:
    def swap(x):
        return renames.get(x.name, x) if isinstance(x, Proxy) else x
    args, kwargs = tree.map_leaves(swap, (b.args, b.kwargs))
    return b.replace(args=args, kwargs=kwargs, outputs=tree.map_leaves(swap, b.outputs))


def _without_grad_mode(lines: list[BoundSymbol]) -> list[BoundSymbol]:
    """Grad mode off from the first line to the last; the switches of it the program makes
    are kept for the one it leaves."""
    leaves = torch.is_grad_enabled()
    kept = []
    for b in lines[:-1]:
        if b.symbol is glue.SET_GLOBAL_STATE:
            switches = dict(b.args[0])
            leaves = switches.pop(0, leaves)
            if not switches:
                continue
            b = b.replace(args=(tuple(switches.items()),))
        kept.append(b)
    return [_grad_mode(False), *kept, *([_grad_mode(True)] if leaves else []), lines[-1]]


def _grad_mode(enabled: bool) -> BoundSymbol:
    return BoundSymbol(glue.SET_GLOBAL_STATE, (((0, enabled),),), tags={MUTATION})
