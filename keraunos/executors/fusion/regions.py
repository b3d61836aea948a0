"""Regions: maximal runs of lines a fusion executor claimed, made safe to hand over as one graph.

A region is compiled as a function of its inputs, so only lines whose effect Inductor's graph
reproduces may enter one: no draws from the random number generator (Inductor's generator is not
eager's), no op of unknown effect, no copies made for written inputs, nothing whose shape the
metadata of the trace does not fix. In-place methods that write values (a KV cache's
``k.index_copy_(2, pos, new)``, ``count.add_(1)``) may enter: the graph writes the same memory
(AOTAutograd functionalizes the write, Inductor writes the input back), so a decode step's layer
is one region, not two around the cache writes. A written memory must then reach the region
through one input only and no output may share it, unless the region made it and hands it out
once (``_unsafe_writes``: Inductor's fake inputs each have memory of their own), a write never
moves, and no line moves above a write of what it reads. A slice may have symbolic bounds (``k[..., :input_pos_maxp1, :]``): the graph computes
them from the size symbols. Two more rules keep what the rest of the program can observe exact:

- an output may not share memory with what the region reads: a view of an input computed
  inside a compiled graph comes back as a new tensor (or as a view rebuilt by a wrapper), so the
  line that makes it runs outside;
- outputs that share memory with each other (``q, k, v = qkv.split(...)``) may come back as
  separate tensors, which matters only when the caller receives them; then the line that makes
  the later view runs outside. An output written in place afterwards is made outside too.

Regions are cut where the layer (see ``layers.py``) or the device changes, so that the regions of
identical layers are identical. Lines move where that keeps a layer in one region: a pure line
that is not fused moves before the run it interrupts (a view of a RoPE table that only the first
layer makes), and a fused line moves down to the first line that reads it (the backward
recomputes cheap forward values at its start, which then join their layer's region).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from ...core import glue, tree
from ...core.symbolic import SymbolicValue
from ...core.effects import draws_random, forbidding, is_inplace_by_name, may_move
from ...core.proxies import NumberProxy, Proxy, TensorProxy
from ...core.symbols import BoundSymbol, Code, TorchSymbol
from ...core.tags import MUTATION, OPAQUE, RANDOM
from ...torch_internals.dispatch import OpOverload, OpOverloadPacket
from . import float_symbols, symbolic

# Regions with fewer lines that allocate memory (the rest are views) are not worth a compile.
MIN_COMPUTE_LINES = 2
# The minimum in force: a context variable, so that ``fusing_single_ops`` in one thread (or
# asyncio task) leaves the compilations of the others alone.
_min_compute_lines: contextvars.ContextVar[int] = contextvars.ContextVar(
    "keraunos_fusion_min_compute_lines", default=MIN_COMPUTE_LINES)


@contextlib.contextmanager
def fusing_single_ops():
    """Within it (in this thread), a region of one op is compiled too: the OpInfo sweep with
    fusion runs each op through Inductor, not through the torch executor as too small a region."""
    token = _min_compute_lines.set(1)
    try:
        yield
    finally:
        _min_compute_lines.reset(token)

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
          torch.memory_format, slice, type(Ellipsis))
# Outputs whose shape (or, for histc and nonzero_static, whose layout of values) depends on
# data; capture refuses most, these are kept out regardless.
_DATA_DEPENDENT_NAMES = ("nonzero", "unique", "unique_consecutive", "masked_select", "argwhere",
                         "bincount", "histc", "nonzero_static")


def _data_dependent_callables() -> dict[int, object]:
    """The torch functions and methods of those names, and their ATen ops, by id (the values
    keep them alive); ATen ops that PyTorch tags as data dependent are found by their tags."""
    aten = torch.ops.aten
    found = [getattr(namespace, name) for name in _DATA_DEPENDENT_NAMES
             for namespace in (torch, torch.Tensor, aten) if hasattr(namespace, name)]
    found += [getattr(p, o) for p in found if isinstance(p, OpOverloadPacket)
              for o in p.overloads()]
    return {id(f): f for f in found}


_DATA_DEPENDENT = _data_dependent_callables()
_DATA_DEPENDENT_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output})


def _depends_on_data(symbol: TorchSymbol) -> bool:
    """Whether the op's output shape or values' placement depends on tensor data: by identity
    (a trace names the same op ``torch.nonzero``, ``x.nonzero`` or ``torch.ops.aten.nonzero``)."""
    if id(symbol.fn) in _DATA_DEPENDENT:
        return True
    op = symbol.fn
    return isinstance(op, OpOverload) and bool(_DATA_DEPENDENT_TAGS & set(op.tags))


# BatchNorm's backward: per-channel sums over every other dimension (of the gradient, and of
# the gradient times the normalized input). Inductor's CPU reductions accumulate each lane of a
# sum in order, where eager's kernel sums in a cascade; on a deep stack of conv-BN-ReLU blocks
# the fused backward's error against float64 grew to 4-5x eager's own (the later blocks' weight
# and bias gradients), on eager's kernel it stays within 2x. So these lines run outside
# regions; the pointwise work around them still fuses. The forward's statistics (Inductor's
# Welford reduction) stay as accurate as eager's and fuse.
def _batch_norm_backward_ops() -> frozenset[int]:
    aten, found = torch.ops.aten, set()
    for name in ("native_batch_norm_backward", "batch_norm_backward"):
        packet = getattr(aten, name, None)
        if packet is not None:
            found |= {id(packet)} | {id(getattr(packet, o)) for o in packet.overloads()}
    return frozenset(found)


_BATCH_NORM_BACKWARD = _batch_norm_backward_ops()


_STYLES = frozenset({"function", "method", "operator", "getitem", "getter"})
# The attributes that are views (``x @ w.T``); ``x.grad``, ``x.data`` and the like read the
# tensor object itself, which a compiled graph cannot. (``H`` and ``mH`` are ``T`` and ``mT`` here:
# complex tensors stay outside regions.)
_VIEW_GETTERS = (torch.Tensor.T, torch.Tensor.mT, torch.Tensor.H, torch.Tensor.mH)
# ``repeat_interleave``, whose repeats may be a tensor (a size from data).
_REPEAT_INTERLEAVE = (torch.repeat_interleave, torch.Tensor.repeat_interleave,
                      torch.ops.aten.repeat_interleave)


# Keyword arguments that are Scalars in ATen's schemas (``addcdiv(..., value=)``,
# ``add(..., alpha=)``), which eager also takes as a 0-dim tensor.
_SCALAR_FACTORS = ("value", "alpha")


def fusible(bsym: BoundSymbol) -> bool:
    """Whether a line may enter a region (the fusion executor's per-line claim)."""
    symbol = bsym.symbol
    if not isinstance(symbol, TorchSymbol) or symbol.style not in _STYLES:
        return False
    if symbol.style == "getter" and not any(symbol.attribute is g for g in _VIEW_GETTERS):
        return False
    forbidden = forbidding(bsym, "fuse")
    if not _own_write_tag(bsym):
        forbidden = forbidden - {MUTATION}
    if forbidden - {MUTATION} or _draws_random(bsym):
        return False
    if (forbidden or is_inplace_by_name(symbol)) and not _fusible_write(bsym):
        return False
    if _depends_on_data(symbol) or "out" in bsym.kwargs or "generator" in bsym.kwargs:
        return False
    if id(symbol.fn) in _BATCH_NORM_BACKWARD:
        return False
    if bsym.kwargs.get("requires_grad"):  # a new leaf of autograd: a compiled graph makes none
        return False
    if any(isinstance(bsym.kwargs.get(k), TensorProxy) for k in _SCALAR_FACTORS):
        return False  # a 0-dim tensor as a Scalar (``value=t``): Inductor reads it with .item()
    if any(symbol.fn is r for r in _REPEAT_INTERLEAVE) and any(  # tensor repeats: from data
            isinstance(x, TensorProxy) for x in tree.leaves((bsym.args[1:], bsym.kwargs))):
        return False
    leaves = tree.leaves((bsym.args, bsym.kwargs))
    others = [x for x in leaves if not (isinstance(x, TensorProxy) or _size_argument(x) or
                                        _plain(x))]
    if others and not (all(map(float_symbols.is_float_argument, others)) and  # a varying lr
                       float_symbols.takes_float_operand(bsym, leaves)):
        return False
    outputs = [x for x in tree.leaves(bsym.outputs) if x is not None]
    if not outputs and writes(bsym) is not None:  # ``cache.index_copy_(...)``, result unused
        outputs = [bsym.args[0]]
    if not outputs or not all(isinstance(x, TensorProxy) for x in outputs):
        return False
    tensors = [x for x in leaves if isinstance(x, TensorProxy)] + outputs
    return all(_supported(t) for t in tensors) and len({t.device for t in tensors}) == 1


# In-place methods that change a tensor's metadata or storage, not only its values: a compiled
# graph cannot replay them on its input. By id (the values keep the methods alive); ATen's
# in-place overloads of these names by name.
_METADATA_WRITE_NAMES = ("resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_",
                         "transpose_", "t_", "swapdims_", "swapaxes_", "detach_",
                         "requires_grad_", "share_memory_", "fix_", "map_", "apply_", "map2_")
_METADATA_WRITES = {id(m): m for m in (getattr(torch.Tensor, name)
                                       for name in _METADATA_WRITE_NAMES)}


def _own_write_tag(bsym: BoundSymbol) -> bool:
    """Whether the line's ``MUTATION`` tag says that the line itself writes. The forward of the
    autograd split runs a torch line as its ATen calls, each with the torch line's tags: an
    activation applied in place (``F.hardswish(h, inplace=True)``) becomes the copy autograd saves
    of ``h`` (``aten.clone``) and the write (``aten.hardswish_``), both tagged. An ATen overload
    whose schema writes nothing (the clone) writes nothing; the schema is the op's own word. (An
    opaque line keeps its tag: its effects are unknown.)"""
    if MUTATION not in bsym.tags:
        return False
    fn = getattr(bsym.symbol, "fn", None)
    return not (isinstance(fn, OpOverload) and not fn._schema.is_mutable
                and OPAQUE not in bsym.tags)


def _aten_write(op) -> bool:
    """An ATen in-place overload that writes its first argument, only it, and returns it
    (``aten.hardswish_.default``, ``aten.add_.Tensor``), and not its metadata (``aten.t_``)."""
    if not isinstance(op, OpOverload):
        return False
    schema = op._schema
    arguments, returns = schema.arguments, schema.returns

    def written(a):
        return a.alias_info is not None and a.alias_info.is_write
    return (schema.name.endswith("_") and bool(arguments) and written(arguments[0])
            and not any(written(a) for a in arguments[1:]) and len(returns) == 1
            and written(returns[0])
            and schema.name.split("::")[-1] not in _METADATA_WRITE_NAMES)


def _fusible_write(bsym: BoundSymbol) -> bool:
    """An in-place method that a region may run: it writes the values of its first argument
    (``k_cache.index_copy_(2, pos, k)``, ``count.add_(1)``, or an activation's
    ``F.silu(h, inplace=True)``, as ``nn.SiLU(inplace=True)`` calls it) and hands it back; Inductor's graph
    writes the same memory. Its other tensors must not share that memory (an overlapping write
    reads what it writes). A tensor that requires grad may be written in the forward trace of
    keraunos's autograd split (T5's ``scores += position_bias``): autograd records nothing there;
    where it does record (no backward trace of ours), ``fuse`` keeps such lines out. Which other inputs of a region
    may share the written memory is the region's rule (``_unsafe_writes``)."""
    symbol = bsym.symbol
    short = symbol.name.rsplit(".", 1)[-1]  # PyTorch's naming convention: ``add_``
    inplace_function = symbol.style == "function" and bsym.kwargs.get("inplace") is True
    if not inplace_function and not _aten_write(symbol.fn) and (
            symbol.style != "method" or not short.endswith("_") or short.endswith("__")
            or id(symbol.fn) in _METADATA_WRITES):
        return False
    target = bsym.args[0] if bsym.args else None
    if not isinstance(target, TensorProxy) or target.storage is None:
        return False  # (a trace that autograd records keeps tensors requiring grad out: ``fuse``)
    if any(type(st) is int and st == 0 and not (type(n) is int and n == 1)
           for n, st in zip(target.shape, target.stride)):
        return False  # an expanded tensor: eager's kernel refuses to write it, Inductor's would
    made = [x for x in tree.leaves(bsym.outputs) if x is not None]
    if len(made) > 1 or made and not (isinstance(made[0], TensorProxy)
                                      and made[0].storage == target.storage):
        return False  # (its result: the tensor written, or a name the input had before)
    others = tree.leaves((bsym.args[1:], bsym.kwargs))
    return not any(isinstance(x, TensorProxy) and x.storage == target.storage for x in others)


def writes(bsym: BoundSymbol) -> TensorProxy | None:
    """The tensor an in-place torch line writes (its first argument), if it writes one."""
    if not isinstance(bsym.symbol, TorchSymbol) or not bsym.args or not isinstance(
            bsym.args[0], TensorProxy):
        return None
    return bsym.args[0] if _own_write_tag(bsym) or is_inplace_by_name(bsym.symbol) else None


def _size_argument(x) -> bool:
    """A symbolic size as an argument: a size symbol (``s0``) or an expression of them (``2*s0``)
    that the region's graph can compute (see ``symbolic.py``)."""
    if isinstance(x, SymbolicValue):
        return isinstance(x.value, torch.SymInt) and symbolic.backed(x.value) and \
            symbolic.expression_supported(x.value.node.expr)
    return isinstance(x, NumberProxy) and x.python_type is int and x.symbol is not None


def _plain(x) -> bool:
    """A constant the FX graph can hold as is, or a slice whose bounds are ints or sizes the
    graph computes (``k[..., :input_pos_maxp1, :]``: ``s0``)."""
    if type(x) is slice:
        return all(v is None or type(v) is int or _size_argument(v)
                   for v in (x.start, x.stop, x.step))
    return isinstance(x, _PLAIN) and not isinstance(x, Code)


def _slice_bounds(leaves) -> list:
    """The bounds of the slices among ``leaves`` (pytree keeps a slice as one leaf)."""
    return [v for x in leaves if type(x) is slice for v in (x.start, x.stop, x.step)]


def _supported(t: TensorProxy) -> bool:
    """Sizes and strides: ints, or symbolic sizes the prologue binds (not sizes from data)."""
    return (all(type(d) is int or (isinstance(d, torch.SymInt) and symbolic.backed(d))
                for d in (*t.shape, *t.stride))
            and t.device.type in ("cpu", "cuda") and not t.dtype.is_complex
            and t.dtype not in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2))


def _draws_random(bsym: BoundSymbol) -> bool:
    return draws_random(bsym.symbol, bsym.args, bsym.kwargs)


class _Proxies:
    """Each line's proxies, found once (walking arguments with pytree is the slow part of forming
    the regions of a long trace), and each tensor's memory (``storage``).

    The rules compare memories through ``storage``, not a proxy's ``storage`` field alone: the
    forward of the autograd split holds the capture's lines and the ATen calls of the lines it
    lowered, whose proxies were recorded apart, so one name can carry two storage numbers (a
    view ``a[:, 1:3]`` of the copy of a written input, then ``aten.clamp_`` of that view). Storage
    numbers that one name carries are one memory here."""

    def __init__(self, lines: list[BoundSymbol] = ()):
        self._memo: dict[int, tuple] = {}
        self._parent: dict[int, int] = {}
        first: dict[str, int] = {}  # name -> the storage number it carried first
        for b in lines:
            for p in (*b.input_proxies(), *b.output_proxies()):
                number = getattr(p, "storage", None)
                if isinstance(p, TensorProxy) and number is not None:
                    self._union(first.setdefault(p.name, number), number)

    def _find(self, number: int) -> int:
        parent = self._parent.get(number, number)
        if parent == number:
            return number
        root = self._parent[number] = self._find(parent)
        return root

    def _union(self, a: int, b: int) -> None:
        a, b = self._find(a), self._find(b)
        if a != b:
            self._parent[max(a, b)] = min(a, b)

    def storage(self, p) -> int | None:
        """The memory of tensor ``p`` (None: not known, or not a tensor)."""
        number = getattr(p, "storage", None)
        return None if number is None else self._find(number)

    def _of(self, bsym: BoundSymbol) -> tuple:
        found = self._memo.get(id(bsym))
        if found is None:
            ins = bsym.input_proxies()  # and the size symbols of expressions (``2*s0``),
            leaves = tree.leaves((bsym.args, bsym.kwargs))  # slices' bounds included
            bounds = _slice_bounds(leaves)
            for x in leaves + bounds:
                if isinstance(x, SymbolicValue):
                    read = x.proxies
                elif isinstance(x, Proxy) and any(x is b for b in bounds):
                    read = (x,)  # a size symbol as a slice's bound (a leaf is an input already)
                else:
                    continue
                ins += [p for p in read if p.name not in {q.name for q in ins}]
            outs = bsym.output_proxies()
            written = writes(bsym)
            if written is not None and [p.name for p in outs] != [written.name] \
                    and _fusible_write(bsym):
                outs = []  # ``cache.index_copy_(...)`` bound to the name the input had before
            found = self._memo[id(bsym)] = (bsym, ins, outs, _all_proxies(bsym) + ins)
        return found

    def ins(self, bsym):
        return self._of(bsym)[1]

    def outs(self, bsym):
        return self._of(bsym)[2]

    def all(self, bsym):
        return self._of(bsym)[3]


def _allocates(bsym: BoundSymbol, io: _Proxies) -> bool:
    """A line whose outputs live in new memory (not a view of what it reads)."""
    read = {io.storage(p) for p in io.ins(bsym) if isinstance(p, TensorProxy)}
    return any(io.storage(p) is None or io.storage(p) not in read for p in io.outs(bsym))


@dataclass
class Region:
    """A run of lines ``[start, stop)`` of a trace, with what it reads and what it hands on."""

    start: int
    stop: int
    lines: list[BoundSymbol]
    layer: str | None
    inputs: list[TensorProxy] = field(default_factory=list)
    outputs: list[TensorProxy] = field(default_factory=list)
    written_inputs: list[int] = field(default_factory=list)  # inputs whose memory it writes


def find_regions(lines: list[BoundSymbol], claimed: list[bool], layers: list[str | None],
                 observable: set[str]) -> tuple[list[BoundSymbol], list[Region]]:
    """The regions of a trace's lines, and the lines in the order the regions need.

    ``claimed[i]``: the fusion executor claimed line ``i``; ``observable``: names whose memory
    sharing the program's caller can see (returned values). Lines that break a rule above are
    given back and the runs are formed again until every region keeps the rules. A pure line
    that is not fused and reads nothing of the run it sits in moves before the run, so that it
    does not cut the run in two (a view of a RoPE table made inside the first layer only)."""
    claimed = list(claimed)
    first, moved = _scalars_first(lines, claimed, _Proxies(lines))
    lines, claimed = [lines[i] for i in first], [claimed[i] for i in first]
    layers = [_SCALARS if i in moved else layers[i] for i in first]
    io = _Proxies(lines)
    minimum = _min_compute_lines.get()
    while True:
        sunk = _sunk(lines, claimed, layers, io)
        order = [sunk[k] for k in _hoisted([lines[i] for i in sunk], [claimed[i] for i in sunk],
                                           [layers[i] for i in sunk], io)]
        ordered = [lines[i] for i in order]
        regions = _runs(ordered, [claimed[i] for i in order], [layers[i] for i in order], io)
        last_write = _last_writes(ordered, io)
        refused = [order[k] for r in regions
                   for k in _unsafe_lines(r, observable, last_write, io) + _unsafe_writes(r, io)
                   + _inlined_scalars(r, io)]
        if not refused:
            kept = [r for r in regions if sum(_allocates(b, io) for b in r.lines) >= minimum]
            for r in kept:
                memories = {io.storage(w) for w in map(writes, r.lines) if w is not None}
                r.written_inputs = [k for k, p in enumerate(r.inputs)
                                    if isinstance(p, TensorProxy) and io.storage(p) in memories]
            return ordered, kept
        for i in refused:
            claimed[i] = False


# The layer key of the 0-dim values moved ahead of the first larger computation
# (``_scalars_first``): their own region, never one with the tensors that read them.
_SCALARS = "(0-dim values)"


def _scalars_first(lines: list[BoundSymbol], claimed: list[bool],
                   io: _Proxies) -> tuple[list[int], set[int]]:
    """The line order with each claimed line of only 0-dim tensors that can run before the
    trace's first claimed line of larger tensors moved there, in their order: an optimizer's
    step counts and bias corrections for every parameter (they read its state, inputs of the
    trace) then run as one region ahead of the updates, instead of cutting the updates into a
    region per parameter. A line that cannot go that far moves as far up as it can where that
    is just after a line not claimed (a switch of autocast). A line moves above no line that
    makes a value it reads, writes memory it reads or writes, or reads memory it writes, and
    above no switch of grad mode or autocast and no opaque call."""
    start = next((k for k, b in enumerate(lines) if claimed[k] and not _only_0_dim(b)), None)
    if start is None:
        return list(range(len(lines))), set()
    moved: dict[int, list[int]] = {}  # position in the lines kept in place -> lines moved there
    kept: list[int] = list(range(start + 1))
    last = 0  # moved lines keep their order among themselves
    feeding = _feeding_larger(lines, claimed, io) & _read_inputs(lines, io)
    for i in range(start + 1, len(lines)):
        b = lines[i]
        if i in feeding and (_movable(b) or writes(b) is not None):
            at = max(_earliest(b, [lines[k] for k in kept], io), last)
            # (the lines before ``start`` are all kept, in place); or just after a line that
            # is not claimed, which cuts the runs there anyway: where autocast is switched off
            # after the forward, the step counts of an optimizer after the backward run ahead
            # of the backward's region instead of cutting the updates apart
            if at <= start or not claimed[kept[at - 1]]:
                moved.setdefault(at, []).append(i)
                last = at
                continue
        kept.append(i)
    if not moved:
        return list(range(len(lines))), set()
    order: list[int] = []
    for position, i in enumerate(kept):
        order += moved.get(position, [])
        order.append(i)
    return order, {i for group in moved.values() for i in group}


def _feeding_larger(lines: list[BoundSymbol], claimed: list[bool], io: _Proxies) -> set[int]:
    """The claimed lines of only 0-dim tensors whose values claimed lines of larger tensors
    read, directly or through other such lines (a step count's bias correction; not
    BatchNorm's ``num_batches_tracked``, which nothing larger reads)."""
    read: set[str] = set()
    found: set[int] = set()
    for i in range(len(lines) - 1, -1, -1):
        b = lines[i]
        if not claimed[i]:
            continue
        ins = {p.name for p in io.ins(b)}
        if not _only_0_dim(b):
            read |= ins
            continue
        written = writes(b)
        if {p.name for p in io.outs(b)} & read or (written is not None and written.name in read):
            found.add(i)
            read |= ins
    return found


def _read_inputs(lines: list[BoundSymbol], io: _Proxies) -> set[int]:
    """The lines of only 0-dim tensors that read a tensor the trace takes as input (an
    optimizer's step count), directly or through other such lines; a constant made in the
    trace (``torch.tensor(2.0)``) costs nothing where Inductor inlines it."""
    made = {p.name for b in lines for p in io.outs(b)}
    rooted: set[str] = set()
    found: set[int] = set()
    for i, b in enumerate(lines):
        if not _only_0_dim(b):
            continue
        tensors = [p for p in io.ins(b) if isinstance(p, TensorProxy)]
        if any(p.name not in made or p.name in rooted for p in tensors):
            found.add(i)
            rooted.update(p.name for p in io.outs(b))
            written = writes(b)
            if written is not None:
                rooted.add(written.name)
    return found


def _earliest(bsym: BoundSymbol, before: list[BoundSymbol], io: _Proxies) -> int:
    """How many of the lines ``before`` must stay before ``bsym``."""
    reads = {p.name for p in io.ins(bsym)}
    read_memory = {io.storage(p) for p in io.ins(bsym) if isinstance(p, TensorProxy)}
    written = writes(bsym)
    written_memory = io.storage(written) if written is not None else None
    for k in range(len(before) - 1, -1, -1):
        b = before[k]
        if not isinstance(b.symbol, TorchSymbol) and b.symbol is glue.SET_GLOBAL_STATE or \
                OPAQUE in b.tags:
            return k + 1
        if {p.name for p in io.outs(b)} & reads:
            return k + 1
        wrote = {io.storage(p) for p in _written(b, io) + [w for w in [writes(b)] if w]}
        if wrote & (read_memory | {written_memory}):
            return k + 1
        if written_memory is not None and written_memory in {
                io.storage(p) for p in io.all(b) + io.outs(b) if isinstance(p, TensorProxy)}:
            return k + 1
    return 0


def _inlined_scalars(region: Region, io: _Proxies) -> list[int]:
    """The lines of only 0-dim tensors in a region whose values larger tensors of the region
    read (an optimizer's step count and bias corrections, ``1 - beta ** step``, read by its
    update): Inductor inlines such a value into the loop of every tensor that reads it and
    computes its powers and roots again for each element (AdamW's update took 3x the time of
    torch's fused kernel). Given back, they run once each on the torch executor, before the
    region. (A counter nothing larger reads, BatchNorm's ``num_batches_tracked``, stays.)"""
    found = _feeding_larger(region.lines, [True] * len(region.lines), io)
    return [region.start + k for k in sorted(found)] if len(found) < len(region.lines) else []


def _only_0_dim(bsym: BoundSymbol) -> bool:
    tensors = [x for x in tree.leaves((bsym.args, bsym.kwargs, bsym.outputs))
               if isinstance(x, TensorProxy)]
    return bool(tensors) and all(t.shape == () for t in tensors)


def _sunk(lines, claimed, layers, io: _Proxies) -> list[int]:
    """The line order with each claimed line moved down to just before the first line that reads
    it, when that line is claimed for the same layer and nothing but pure lines lie between: the
    backward recomputes cheap forward values at its start, which then join their layer's region.

    Each line gets a sort key: its own position, or (sunk) just below the smallest key of the
    lines reading it, so that a line always stays before every line that reads it."""
    readers: dict[str, list[int]] = {}
    for i, b in enumerate(lines):
        for p in io.ins(b):
            readers.setdefault(p.name, []).append(i)
    barrier_after = [len(lines)] * (len(lines) + 1)
    for i in range(len(lines) - 1, -1, -1):
        barrier_after[i] = i if not _movable(lines[i]) else barrier_after[i + 1]
    keys: list[tuple] = [()] * len(lines)
    for i in range(len(lines) - 1, -1, -1):
        keys[i] = (i, 0, i)
        later = [j for p in io.outs(lines[i]) for j in readers.get(p.name, ()) if j > i]
        if not claimed[i] or not later or not _movable(lines[i]):
            continue  # (a write stays where it is: other names may read the memory it writes)
        first = min(later, key=lambda j: keys[j])
        if claimed[first] and layers[first] == layers[i] and keys[first][0] <= barrier_after[i + 1]:
            keys[i] = (keys[first][0], keys[first][1] - 1, i)
    return sorted(range(len(lines)), key=lambda i: keys[i])


def _hoisted(lines, claimed, layers, io: _Proxies) -> list[int]:
    """The line order with each movable line that is not claimed moved before the claimed run
    it interrupts, when it reads nothing that run defines; and each random draw into memory the
    run does not touch (``_draw_above_run``)."""
    order: list[int] = []
    run_start, run_key, run_defined, run_written, run_touched = None, None, set(), set(), set()
    for i, b in enumerate(lines):
        if claimed[i]:
            key = (layers[i], _device(b, io))
            if run_start is None or key != run_key:
                run_start, run_key = len(order), key
                run_defined, run_written, run_touched = set(), set(), set()
            order.append(i)
            run_defined.update(p.name for p in io.outs(b))
            run_touched.update(io.storage(p) for p in io.all(b) + io.outs(b)
                               if isinstance(p, TensorProxy))
            written = writes(b)
            if written is not None:
                run_written.add(io.storage(written))
        elif run_start is not None and not (
                {p.name for p in io.ins(b)} & run_defined) and not (
                {io.storage(p) for p in io.ins(b) if isinstance(p, TensorProxy)} & run_written) \
                and (_movable(b) or _draw_above_run(b, run_touched, io)):
            order.insert(run_start, i)  # (not above a write of the memory it reads)
            run_start += 1
        else:
            order.append(i)
            run_start = None
    return order


def _movable(bsym: BoundSymbol) -> bool:
    """A line whose only effect is its outputs: it may run earlier than written. The binding
    of an input written in place to its new name (``x_updated = x``) is one: between the
    regions of an optimizer's step counts it would cut them into a region per parameter."""
    if bsym.symbol is glue.ALIAS:
        return True
    return (isinstance(bsym.symbol, TorchSymbol)
            and may_move(bsym) and not is_inplace_by_name(bsym.symbol) and not _draws_random(bsym))


def _draw_above_run(bsym: BoundSymbol, run_touched: set, io: _Proxies) -> bool:
    """A random draw whose only other effect is a write of memory that the claimed run before it
    neither reads nor makes: stochastic depth's ``noise.bernoulli_(p)`` into a ``torch.empty``,
    between a block's body and ``noise.div_(p)``, ``x * noise``, ``+= input``. It may run
    before the run: a region never draws (``fusible``), so the draws keep their order among
    themselves and the generator's stream is eager's, and the run cannot see what it wrote.
    The block is then one region instead of a region, five eager lines and their backward."""
    if not (isinstance(bsym.symbol, TorchSymbol) and _draws_random(bsym)
            and forbidding(bsym, "move") <= {RANDOM, MUTATION}):
        return False
    written = writes(bsym)
    touched = _written(bsym, io) + io.outs(bsym) + ([written] if written is not None else [])
    memories = {io.storage(p) for p in touched if isinstance(p, TensorProxy)}
    return None not in memories and not (memories & run_touched)


def _runs(lines, claimed, layers, io: _Proxies) -> list[Region]:
    regions: list[Region] = []
    current: list[int] = []

    def close():
        if current:
            start, stop = current[0], current[-1] + 1
            regions.append(Region(start, stop, lines[start:stop], layers[start]))
            current.clear()
    for i, b in enumerate(lines):
        if not claimed[i]:
            close()
            continue
        if current and (layers[i] != layers[current[0]]
                        or _device(b, io) != _device(lines[current[0]], io)):
            close()
        current.append(i)
    close()
    last_use = {}
    for i, b in enumerate(lines):
        for p in io.all(b):
            last_use[p.name] = i
    for r in regions:
        _connect(r, last_use, io)
    return regions


def _device(bsym: BoundSymbol, io: _Proxies):
    made = io.outs(bsym)
    return made[0].device if made else writes(bsym).device  # a write whose result is unused


def _connect(region: Region, last_use: dict[str, int], io: _Proxies) -> None:
    """The region's inputs (read, defined before it) and outputs (defined in it, read after)."""
    defined: dict[str, TensorProxy] = {}
    inputs: dict[str, TensorProxy] = {}
    for b in region.lines:
        for p in io.ins(b):
            if p.name not in defined and p.name not in inputs:
                inputs[p.name] = p
        for p in io.outs(b):
            if p.name not in inputs:  # ``x.float()`` of a float x: x itself, made before
                defined[p.name] = p
    region.inputs = list(inputs.values())
    region.outputs = [p for name, p in defined.items() if last_use.get(name, -1) >= region.stop]


def _written(bsym: BoundSymbol, io: _Proxies) -> list[TensorProxy]:
    """The tensors a line may write: the first argument of an in-place op (``k_cache.index_copy_(
    0, pos, k)`` writes the cache, not ``k``); every tensor of another line that writes."""
    if not (_own_write_tag(bsym) or OPAQUE in bsym.tags):
        return []
    if isinstance(bsym.symbol, TorchSymbol) and OPAQUE not in bsym.tags \
            and is_inplace_by_name(bsym.symbol) and isinstance(bsym.args[0], TensorProxy):
        return [bsym.args[0]]
    return [p for p in io.all(bsym) if isinstance(p, TensorProxy)]


def _all_proxies(bsym: BoundSymbol) -> list[Proxy]:
    leaves = tree.leaves((bsym.args, bsym.kwargs))
    return [x for x in leaves if isinstance(x, Proxy)]


def _last_writes(lines: list[BoundSymbol], io: _Proxies) -> dict[int, int]:
    """Storage -> the last line that may write it."""
    return {io.storage(p): i for i, b in enumerate(lines) for p in _written(b, io)}


# ``as_strided``, which views a memory at offsets of its own (see ``_unsafe_writes``).
_AS_STRIDED = (torch.as_strided, torch.Tensor.as_strided, torch.ops.aten.as_strided,
               torch.ops.aten.as_strided.default)  # backward traces hold the overload


def _unsafe_writes(region: Region, io: _Proxies) -> list[int]:
    """In-place lines of ``region`` whose memory the region's graph could not write exactly:
    Inductor is given one fake tensor per input, each with memory of its own, so a written
    memory must reach the region through one input only (or be made inside it), and no output
    may share a written input's memory (an output comes back as a tensor of its own); a memory
    made inside may leave as one output, which then holds the written values. Two more rules keep out what
    Inductor (torch 2.13, ``torch.compile`` alike) compiles wrongly, found by the fuzzer with
    fusion (95:704): a memory is written once in a region (after ``a.index_put_(...)``,
    ``a.add_(a * a.sum(0))`` read values the kernel was writing), and the region does not
    view a written memory with ``as_strided`` (as the views of arguments that share memory are
    rebuilt from one storage; a read after a write was off by 1e33)."""
    storage = io.storage
    inputs_of: dict[int, int] = {}
    for p in region.inputs:
        if isinstance(p, TensorProxy) and storage(p) is not None:
            inputs_of[storage(p)] = inputs_of.get(storage(p), 0) + 1
    outputs: dict[int, int] = {}
    for p in region.outputs:
        outputs[storage(p)] = outputs.get(storage(p), 0) + 1
    strided = {storage(p) for b in region.lines if isinstance(b.symbol, TorchSymbol)
               and any(b.symbol.fn is v for v in _AS_STRIDED)
               for p in (*b.input_proxies(), *b.output_proxies()) if isinstance(p, TensorProxy)}
    unsafe, written, written_otherwise = [], set(), set()
    names_written: dict[int, set[str]] = {}  # storage -> the names its writes wrote
    reread: set[int] = set()  # written memory that a line read after its last write
    for k, b in enumerate(region.lines):
        w = writes(b)
        reread |= {storage(p) for p in b.input_proxies()
                   if isinstance(p, TensorProxy) and storage(p) in written
                   and (w is None or p.name != w.name)}
        if w is None:
            continue
        # (``_fusible_write`` asked this of the line's own storage numbers: ask it again)
        overlapping = any(isinstance(p, TensorProxy) and storage(p) == storage(w)
                          for p in b.input_proxies() if p.name != w.name)
        w_storage = storage(w)
        # An output may be memory the region makes and writes (``topk``'s values, then
        # ``div_``): it comes back with the written values, as the one tensor of that memory.
        handed_out = outputs.get(w_storage, 0)
        # Activations applied in place one after another to memory the region made
        # (``nn.Hardswish(inplace=True)`` then ``nn.ReLU(inplace=True)``) are a chain of
        # pointwise values once functionalized: no input memory is written, nothing is reread.
        # So is an activation applied right after another write of the same tensor (a residual
        # block's ``out += identity`` then ``relu(out, inplace=True)``), when no line read the
        # written memory in between: it reads only the values the write left.
        chained = _inplace_activation(b) and w_storage not in inputs_of and (
            w_storage not in written_otherwise
            or (names_written.get(w_storage) == {w.name} and w_storage not in reread))
        if (w_storage is None or overlapping or inputs_of.get(w_storage, 0) > 1
                or (handed_out and (w_storage in inputs_of or handed_out > 1))
                or w_storage in strided or (w_storage in written and not chained)):
            unsafe.append(region.start + k)
        written.add(w_storage)
        names_written.setdefault(w_storage, set()).add(w.name)
        reread.discard(w_storage)
        if not _inplace_activation(b):
            written_otherwise.add(w_storage)
    return unsafe


# ATen's in-place activations that PyTorch does not tag pointwise.
_ACTIVATION_NAMES = ("hardswish_", "gelu_", "mish_")


def _inplace_activation(bsym: BoundSymbol) -> bool:
    """``F.relu(h, inplace=True)`` and the like: a pointwise function written in place; or its
    ATen form in the forward of the autograd split (``aten.hardswish_(h)``), which reads no
    other tensor."""
    if bsym.symbol.style == "function" and bsym.kwargs.get("inplace") is True:
        return True
    op = bsym.symbol.fn
    if not _aten_write(op) or not (torch.Tag.pointwise in op.tags or op._schema.name.split(
            "::")[-1] in _ACTIVATION_NAMES):
        return False
    return not any(isinstance(x, TensorProxy)
                   for x in tree.leaves((bsym.args[1:], bsym.kwargs)))


def _unsafe_lines(region: Region, observable: set[str], last_write: dict[int, int],
                  io: _Proxies) -> list[int]:
    """Lines of ``region`` that make an output whose memory sharing would change."""
    storage = io.storage
    outside = {storage(p) for p in region.inputs if isinstance(p, TensorProxy)}
    written_later = {s for s, i in last_write.items() if i >= region.stop}
    observed = {storage(p) for p in region.outputs if p.name in observable}
    first_of_storage: set[int] = set()
    bad = set()
    for p in region.outputs:  # in the order the region makes them
        if storage(p) is None or storage(p) in outside or storage(p) in written_later:
            bad.add(p.name)  # a view of an input, or memory written in place afterwards
        elif storage(p) in first_of_storage and storage(p) in observed:
            bad.add(p.name)  # a view of an earlier output, and the caller sees the sharing
        first_of_storage.add(storage(p))
    return [region.start + k for k, b in enumerate(region.lines)
            if any(p.name in bad for p in io.outs(b))]

