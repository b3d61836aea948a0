"""Split a computation into a forward trace and a backward trace.

From the joint recording (``joint.py``):
- the backward trace is the ATen ops ``torch.autograd.grad`` ran, reading the gradients of the
  outputs and the tensors it needs from the forward ("saved");
- the forward trace is the computation itself, at the torch level, returning its outputs and the
  saved tensors. A saved tensor that only exists inside a torch-level op (the mean and rstd of
  ``layer_norm``, the mask of ``dropout``) makes that one op run as its ATen ops instead, so the
  forward can hand it over; every other line stays as the user wrote it.
- ``RULES`` may give an op a derivative of our own in place of PyTorch's; see ``rules.py``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..core.symbolic import as_code, expr_key, is_backed, layout_key
from ..core.aten import constant_line, is_lifted_constant
from ..core import glue
from ..core.proxies import NumberProxy, ObjectProxy, TensorProxy
from ..core.symbols import BoundSymbol, Code, TorchSymbol
from ..core.tags import MUTATION, RANDOM
from ..core.runner import trace_step
from ..core.trace import Trace
from .joint import record_joint
from .recompute import recompute_in_backward, recompute_views_in_backward


@dataclass
class Split:
    forward: Trace
    backward: Trace
    differentiable: list[int]   # which forward outputs get gradients
    n_outputs: int
    # For each computation input: which gradients of outputs (indices into ``differentiable``)
    # its gradient depends on; an input none of whose outputs got a gradient gets None, as eager.
    grad_dependencies: list[set[int]]
    # (shape, dtype, device) of each differentiable output, for zeros where no gradient came.
    grad_metadata: list[tuple]
    # The forward returns its saved tensors, then the data-dependent sizes the backward needs.
    n_saved_tensors: int = 0
    # Sizes are symbolic: a size left in either trace as a constant would be wrong
    # (``refuse_raw_symbols``, after the backward's optimizations).
    symbolic: bool = False
    # backward -> backward whose returned gradients share no memory (after its optimizations:
    # CSE would merge the copies it makes).
    place_gradients: Callable[[Trace], Trace] | None = None


class _Names:
    def __init__(self, taken: set[str]):
        self.taken = set(taken)
        self.counters: dict[str, int] = {}

    def fresh(self, prefix: str) -> str:
        n = self.counters.get(prefix, 0)
        while f"{prefix}{n}" in self.taken:
            n += 1
        self.counters[prefix] = n + 1
        self.taken.add(f"{prefix}{n}")
        return f"{prefix}{n}"


def _aten_symbol(func) -> TorchSymbol:
    return TorchSymbol(func, f"torch.ops.{func}", "function")


def _tensor_leaves(tree) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return None


class _Namer:
    """Which name each fake tensor goes by, and its proxy."""

    def __init__(self, names: _Names):
        self.names = names
        self.name_of: dict[int, str] = {}
        self.proxies: dict[str, TensorProxy] = {}
        self.fakes: dict[str, torch.Tensor] = {}

    def bind(self, fake, name: str) -> None:
        if id(fake) not in self.name_of:
            self.name_of[id(fake)] = name
            self.proxies[name] = TensorProxy(name, fake)
            self.fakes[name] = fake

    def name(self, fake, prefix: str) -> str:
        if id(fake) not in self.name_of:
            self.bind(fake, self.names.fresh(prefix))
        return self.name_of[id(fake)]

    def alias_of(self, fake) -> str | None:
        """A known tensor with the same memory and metadata (autograd may hand a saved tensor
        back as a new object over the same memory)."""
        key = _storage_key(fake)
        for name, other in self.fakes.items():
            # Compared as expressions: ``==`` on symbolic sizes would add guards.
            if (_storage_key(other) == key and layout_key(other) == layout_key(fake)
                    and expr_key(other.storage_offset()) == expr_key(fake.storage_offset())
                    and other.dtype == fake.dtype):
                return name
        return None


class _SavedSizes:
    """Sizes that depend on data (``x[mask]`` has as many elements as ``mask`` has True values)
    which the backward needs: the forward reads each from a tensor of its own that has it and
    returns it with the saved tensors, so the backward never names a forward value it lacks."""

    def __init__(self, namer: _Namer, forward_names: set[int]):
        self.namer = namer
        self.forward_names = forward_names  # ids of fakes the forward trace names
        self.proxies: dict[Any, ObjectProxy] = {}  # size expression -> its name
        self.lines: list[tuple[str, BoundSymbol]] = []  # (tensor read, line reading its size)

    def proxy(self, size) -> ObjectProxy:
        expr = size.node.expr
        if expr not in self.proxies:
            tensor, dim = _tensor_with_size(size, self.namer, self.forward_names)
            proxy = ObjectProxy(self.namer.names.fresh("size"), int)
            self.proxies[expr] = proxy
            self.lines.append((tensor, glue.SIZE.bind(self.namer.proxies[tensor], dim,
                                                      outputs=proxy)))
        return self.proxies[expr]

    def place(self, forward_lines: list[BoundSymbol]) -> list[BoundSymbol]:
        """``forward_lines`` with each size read right after the line that makes its tensor."""
        lines = list(forward_lines)
        for tensor, line in self.lines:
            at = next((i + 1 for i, b in enumerate(lines)
                       if tensor in {p.name for p in b.output_proxies()}), 0)
            lines.insert(at, line)
        return lines


class _Numbers:
    """The forward's symbolic sizes and ints (``s0``, ...), by symbol, and those the backward
    reads (inputs of the backward, returned by the forward)."""

    def __init__(self, computation: Trace):
        self.by_symbol = {p.symbol: p for p in computation.params if isinstance(p, NumberProxy)}
        self.read: dict[str, NumberProxy] = {}

    def __call__(self, x):
        """A size of the backward as trace code over the forward's symbols."""
        if not is_backed(x, self.by_symbol):
            return x  # a size that depends on data: handled where it is read
        value = as_code(x, self.by_symbol)
        for p in getattr(value, "proxies", ()):
            self.read[p.name] = p
        return value


@dataclass
class _Named:
    """Every value of the joint recording named: the torch-level trace's names, then a name for
    each forward ATen value (with the torch-level line that made it)."""

    namer: _Namer
    torch_level: set[int]         # ids of values the torch-level trace names
    forward_known: set[int]       # ids of every forward value
    parent_of: dict[int, int]     # id of a forward ATen value -> index of its torch-level line
    changing: set[str]            # names whose metadata the forward changes in place


def _name_values(computation: Trace, joint) -> _Named:
    taken = {p.name for p in computation.params}
    for b in computation.bound_symbols:
        taken.update(p.name for p in b.output_proxies())
    namer = _Namer(_Names(taken))
    for p, fake in zip(computation.params, joint.inputs):
        if isinstance(fake, torch.Tensor):
            namer.bind(fake, p.name)
    for name, fake in joint.rebound:  # before an in-place metadata change: the same name
        namer.bind(fake, name)
    for name, fake in joint.env.items():
        if isinstance(fake, torch.Tensor):
            namer.bind(fake, name)
    torch_level = set(namer.name_of)
    parent_of: dict[int, int] = {}
    for call in joint.forward_calls:
        for t in _tensor_leaves(call.out):
            namer.name(t, "f")
            parent_of.setdefault(id(t), call.parent)
    # A name whose metadata the forward changes in place names one object at run time, with its
    # last metadata when the forward returns it: the backward must not save it.
    return _Named(namer, torch_level, set(namer.name_of), parent_of,
                  {name for name, _ in joint.rebound})


@trace_step
def split_forward_backward(computation: Trace) -> Split:
    """The forward and backward traces of ``computation``; the pipeline then optimizes the
    backward and gives its gradients memory of their own (``Split.place_gradients``)."""
    joint = record_joint(computation)
    named = _name_values(computation, joint)
    namer, numbers = named.namer, _Numbers(computation)
    # The backward: its inputs are the gradients and what it reads from the forward.
    grad_names = [namer.name(g, "grad") for g in joint.grad_outputs]
    sizes = _SavedSizes(namer, named.torch_level)
    saved, backward_lines = _backward_lines(joint, named, sizes, numbers)
    # Views of named values are recomputed; other saved values that exist only inside a
    # torch-level op make that op run as its ATen ops.
    saved, view_lines = recompute_views_in_backward(saved, joint, namer, named.torch_level,
                                                    numbers)
    lowered = {named.parent_of[id(namer.fakes[n])] for n in saved
               if id(namer.fakes[n]) not in named.torch_level
               and id(namer.fakes[n]) in named.parent_of}
    forward_lines = _forward_lines(computation, joint, named, lowered, numbers.by_symbol)
    # Cheap elementwise values are recomputed in the backward rather than saved.
    saved, recomputed = recompute_in_backward(saved, joint, namer, named.parent_of, lowered,
                                              numbers)
    backward_lines = recomputed + view_lines + backward_lines  # views may read recomputed values

    outputs = list(computation.bound_symbols[-1].args[0])
    saved_proxies = [namer.proxies[n] for n in saved]
    size_proxies = list(sizes.proxies.values()) + list(numbers.read.values())
    forward_lines = sizes.place(forward_lines)
    forward_lines.append(glue.RETURN_FORWARD.bind(outputs, saved_proxies + size_proxies))
    backward_lines.append(glue.RETURN_GRADIENTS.bind(_returned_gradients(joint, namer)))
    forward = computation.derive(forward_lines, "Autograd Split (forward)")
    backward = Trace("backward", saved_proxies + size_proxies +
                     [namer.proxies[n] for n in grad_names],
                     backward_lines, ["Constructed by Autograd Split (backward)"])
    dependencies = [joint.reached_from.get(i, set()) for i in range(len(joint.inputs))]
    metadata = [(tuple(g.shape), g.dtype, g.device) for g in joint.grad_outputs]
    return Split(forward, backward, joint.differentiable, len(outputs), dependencies, metadata,
                 len(saved_proxies), bool(numbers.by_symbol),
                 functools.partial(_gradients_in_own_memory, namer=namer, mode=joint.keep_alive[0]))


def _backward_lines(joint, named: _Named, sizes: _SavedSizes,
                    numbers: _Numbers) -> tuple[list[str], list[BoundSymbol]]:
    """The backward's ATen calls as lines, and the forward values they read (to be saved)."""
    namer = named.namer
    saved: list[str] = []
    lines: list[BoundSymbol] = []
    produced: set[int] = {id(g) for g in joint.grad_outputs}

    def saved_value(x, call) -> str:
        if id(x) in named.forward_known:
            name = namer.name_of[id(x)]
        else:
            name = namer.alias_of(x)
            if name is None:
                raise NotImplementedError(f"the backward of {call.func} reads a tensor "
                                          f"the forward did not produce")
        if name in named.changing:
            raise NotImplementedError(
                f"the backward of {call.func} reads {name}, whose metadata the forward "
                f"changes in place ({name}.t_(), .unsqueeze_(), ...)")
        if name not in saved:
            saved.append(name)
        return name

    for call in joint.backward_calls:
        if is_lifted_constant(call):
            produced.add(id(call.out))
            lines.append(constant_line(call.args[0], namer.proxies[namer.name(call.out, "b")]))
            continue

        def arg(x, call=call):
            if isinstance(x, torch.Tensor):
                if id(x) in produced:
                    return namer.proxies[namer.name_of[id(x)]]
                return namer.proxies[saved_value(x, call)]
            if isinstance(x, (torch.SymInt, torch.SymFloat)):
                return numbers(x) if is_backed(x, numbers.by_symbol) else sizes.proxy(x)
            return x
        args, kwargs = pytree.tree_map(arg, (call.args, call.kwargs))
        outputs = pytree.tree_map(
            lambda t: namer.proxies[namer.name(t, "b")] if isinstance(t, torch.Tensor) else t,
            call.out)
        produced.update(id(t) for t in _tensor_leaves(call.out))
        tags = {MUTATION} if call.func._schema.is_mutable else set()
        lines.append(BoundSymbol(_aten_symbol(call.func), tuple(args), dict(kwargs), outputs,
                                 tags=tags))
    return saved, lines


def _forward_lines(computation: Trace, joint, named: _Named, lowered: set[int],
                   numbers: dict) -> list[BoundSymbol]:
    """The forward: the torch-level lines, except those in ``lowered``, which run as their ATen
    calls (a value the backward saves exists only inside them)."""
    namer = named.namer
    lines: list[BoundSymbol] = []
    for index, bsym in enumerate(computation.bound_symbols[:-1]):
        if bsym.symbol is glue.SET_GLOBAL_STATE:
            # Function.forward runs with grad mode off (the backward is ours); autocast's
            # switches stay, for the lines that cast inside (UNDER_AUTOCAST).
            switches = tuple((i, v) for i, v in bsym.args[0] if i != 0)
            if switches:
                lines.append(BoundSymbol(glue.SET_GLOBAL_STATE, (switches,), tags=set(bsym.tags),
                                         source=bsym.source))
            continue
        if index not in lowered:
            lines.append(bsym)
            continue
        calls = [c for c in joint.forward_calls if c.parent == index]
        draws = _drawing_calls(calls) if RANDOM in bsym.tags else set()
        for call in calls:
            if is_lifted_constant(call):  # a list index inside __getitem__, say
                lines.append(constant_line(
                    call.args[0], namer.proxies[namer.name_of[id(call.out)]], bsym.source))
                continue
            args, kwargs = pytree.tree_map(
                lambda x: namer.proxies[namer.name_of[id(x)]] if isinstance(x, torch.Tensor)
                else (_size_expression(x, namer, named.forward_known, numbers)
                      if isinstance(x, (torch.SymInt, torch.SymFloat)) else x),
                (call.args, call.kwargs))
            outputs = pytree.tree_map(
                lambda t: namer.proxies[namer.name_of[id(t)]] if isinstance(t, torch.Tensor)
                else t, call.out)
            tags = set(bsym.tags)
            if draws and id(call) not in draws:
                tags.discard(RANDOM)  # the softmax and matmuls around dropout's draw
            if call.func._schema.is_mutable:
                tags.add(MUTATION)
            # (made in the module call the torch line was made in: a layer's lowered batch norm
            # is the layer's, also where no line of the layer follows it, as in a stem's
            # ``Conv2dNormActivation``; see ``executors/fusion/layers.py``)
            lines.append(BoundSymbol(_aten_symbol(call.func), tuple(args), dict(kwargs),
                                     outputs, bsym.source, tags, module_stack=bsym.module_stack))
    return lines


def _returned_gradients(joint, namer: _Namer) -> list:
    """The gradient of each input of the computation (None where it gets none)."""
    grads = []
    for i in range(len(joint.inputs)):
        if i in joint.needs_grad:
            g = joint.grads[joint.needs_grad.index(i)]
            grads.append(namer.proxies[namer.name_of[id(g)]] if g is not None else None)
        else:
            grads.append(None)
    return grads


def _memory_range(fake) -> tuple | None:
    """(storage, first element, one past the last) of a fake tensor, None when unknown."""
    key = _storage_key(fake)
    if key is None or not all(type(n) is int for n in (*fake.shape, *fake.stride())):
        return None
    last = sum((n - 1) * abs(st) for n, st in zip(fake.shape, fake.stride()))
    return key, fake.storage_offset(), fake.storage_offset() + last + 1


def _view_roots(lines: list[BoundSymbol]) -> dict[str, str]:
    """Name -> the name of the value whose memory it views, following the trace's view ops (CSE
    may have made views of one value of what the recording saw as views of two)."""
    root: dict[str, str] = {}
    for b in lines:
        func = getattr(b.symbol, "fn", None)
        reads = [p for p in b.input_proxies() if isinstance(p, TensorProxy)]
        for out in b.output_proxies():
            if getattr(func, "is_view", False) and reads:
                root[out.name] = root.get(reads[0].name, reads[0].name)
    return root


def _may_overlap(a: str, b: str, namer: _Namer) -> bool:
    """Whether two views of one value may overlap; slices the recording saw as disjoint views of
    one tensor (the gradients of ``torch.cat``'s inputs) do not."""
    fa, fb = namer.fakes.get(a), namer.fakes.get(b)
    ra = _memory_range(fa) if fa is not None else None
    rb = _memory_range(fb) if fb is not None else None
    if ra is None or rb is None or ra[0] != rb[0]:
        return True
    return fa.numel() > 0 and fb.numel() > 0 and ra[1] < rb[2] and rb[1] < ra[2]


@trace_step
def _gradients_in_own_memory(backward: Trace, namer: _Namer, mode) -> Trace:
    """Distinct returned gradients never share memory: autograd keeps a gradient it is given as
    the leaf's ``.grad`` when nothing else holds it, so two views of one tensor (``b.view(4)``,
    ``b.view(2, 2)``) would become two ``.grad`` that each later accumulation writes into twice.
    Eager's engine never hands two leaves overlapping memory."""
    *body, ret = backward.bound_symbols
    root = _view_roots(body)
    kept: list[TensorProxy] = []
    grads, clones = [], []
    for g in ret.args[0]:
        if g is None or any(k.name == g.name for k in kept):  # one object twice: autograd
            grads.append(g)                                  # sees the extra reference
            continue
        r = root.get(g.name, g.name)
        if not any(root.get(k.name, k.name) == r and _may_overlap(k.name, g.name, namer)
                   for k in kept):
            kept.append(g)
            grads.append(g)
            continue
        with mode:
            fake = namer.fakes[g.name].clone() if g.name in namer.fakes else None
        if fake is None:
            raise NotImplementedError(f"a gradient {g.name} of unknown metadata")
        copy = namer.proxies[namer.name(fake, "b")]
        clones.append(BoundSymbol(_aten_symbol(torch.ops.aten.clone.default), (g,), {}, copy,
                                  comment="a gradient of its own memory"))
        grads.append(copy)
    if not clones:
        return backward
    return backward.derive(body + clones + [ret.replace(args=(grads,))],
                           "Gradients in their own memory")


def _tensor_with_size(x, namer: _Namer, available: set[int]) -> tuple[str, int]:
    """A tensor at hand (and its dimension) whose size is the data-dependent size ``x``."""
    expr = x.node.expr
    for name, fake in namer.fakes.items():
        if id(fake) not in available:
            continue
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return name, d
    raise NotImplementedError(f"a size {expr} that no tensor at hand has")


def _size_expression(x, namer: _Namer, available: set[int], numbers: dict):
    """A size in the forward: an expression of its symbolic sizes (``s0``), or one that depends
    on data (an unbacked symbol), read from a tensor that has it."""
    if is_backed(x, numbers):
        return as_code(x, numbers)
    name, d = _tensor_with_size(x, namer, available)
    return Code(f"{name}.size({d})")


def _drawing_calls(calls) -> set[int]:
    """Of the ATen calls a random torch-level line runs as (``dropout``, or
    ``scaled_dot_product_attention`` with ``dropout_p``), those that draw from the generator
    (``bernoulli_``: PyTorch tags them ``nondeterministic_seeded``): only they keep the line's
    ``RANDOM`` tag, so that the rest may be fused and merged like any line. Empty when no call
    says it draws: then every call keeps the tag, as before."""
    seeded = torch.Tag.nondeterministic_seeded
    return {id(c) for c in calls if seeded in getattr(c.func, "tags", ())}
