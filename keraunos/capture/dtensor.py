"""DTensors during capture: flattened to their local tensors, their dispatch recorded as local ops.

A ``DTensor`` (``torch.distributed.tensor``) is a wrapper tensor: a *local* tensor (this rank's
shard or replica) and a *spec* (the device mesh, the placements ``Shard(d)``/``Replicate()``/
``Partial()``, the global shape and stride). Its operations run in its ``__torch_dispatch__``:
sharding propagation decides the placements of the result and which inputs to redistribute
first, the redistributions are functional collectives (``torch.ops._c10d_functional.*``) on the
local tensors, and the op itself runs on the local tensors.

Capture lets DTensor do that work, on fake local tensors:

- **inputs** (arguments and parameters, ``dtensor_input``) are flattened: the computation's input
  is the local tensor, unpacked by the prologue (``w_local = w._local_tensor``, or
  ``w.to_local()`` when it requires grad under grad mode, which connects the local to the user's
  DTensor); the program runs on a stand-in DTensor around the local's fake, with the same spec.
  The prologue checks the spec on every call (type, mesh, placements, global shape, stride and
  dtype, ``requires_grad``), then the local tensor as any other input;
- **calls** with a DTensor argument (``record_dtensor_call``) run under a dispatch mode that lets
  DTensor dispatch them (``NotImplemented`` for a wrapper subclass) and records what DTensor then
  runs on the local fakes: local ATen ops and functional collectives with their waits, so the
  trace shows each collective where DTensor issued it. ``from_local``, ``to_local`` and
  ``redistribute`` run their own Python code, whose torch calls on local tensors are recorded as
  any call is;
- **results** that are DTensors are rebuilt by the epilogue around the computation's local
  output, with the spec capture saw (``rebuild_dtensor``), so no fake tensor reaches the user.

Gradients are DTensor's own, recorded at capture: see ``dtensor_autograd.py``. DTensor programs
are compiled for exact sizes (a spec holds its global sizes as numbers). Not captured: DTensor
subclasses and DTensors whose local tensor is itself a wrapper subclass (refused), and, with
gradients, programs that write tensors in place, print, or switch autocast (refused).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..torch_internals.dispatch import (DisableTorchFunction, TorchDispatchMode,
                                       is_traceable_wrapper_subclass)
from ..torch_internals.fake import FakeTensor, unset_fake_temporarily
from ..core.aten import constant_line, is_lifted_constant
from ..core.provenance import Path, PathKind
from ..core.symbolic import SymbolicUnsupported
from ..core.symbols import BoundSymbol, TorchSymbol
from ..core.tags import MUTATION, RANDOM
from ..errors import CaptureError, UnsupportedInputError, user_source
from . import guards
from .guards import GuardKind


@dataclass
class DTensorState:
    """What capture keeps about the program's DTensors (``ctx.dtensors``)."""

    record_aten: bool = False  # every call recorded as ATen ops: DTensors under grad mode
    autograd: bool = False     # DTensor's autograd ran: its backward is capture's to record
    stand_ins: dict = field(default_factory=dict)  # id(real DTensor) -> (real, stand-in)
    of_input: dict = field(default_factory=dict)   # a local input's name -> its stand-in
    grad_placements: dict = field(default_factory=dict)  # ... -> its GradPlacements
    # Objects whose ids must stay theirs while capture maps them, and the real local tensors
    # the compilation checks (``Program.keep_alive``).
    keep_alive: list = field(default_factory=list)
    forward_values: set = field(default_factory=set)  # ids of the forward's fakes


def dtensor_class():
    """``DTensor``, when the program can have one (``torch.distributed.tensor`` was imported)."""
    api = sys.modules.get("torch.distributed.tensor._api")
    return getattr(api, "DTensor", None)


def is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def is_capture_dtensor(t: Any) -> bool:
    """A DTensor made during capture: its local tensor is one of capture's fakes."""
    return is_dtensor(t) and isinstance(t._local_tensor, FakeTensor)


def is_device_mesh(value: Any) -> bool:
    mesh = sys.modules.get("torch.distributed.device_mesh")
    return mesh is not None and isinstance(value, getattr(mesh, "DeviceMesh", ()))


def program_has_dtensors(module, args, kwargs) -> bool:
    """Whether the call passes DTensors, or the module holds some."""
    if dtensor_class() is None:
        return False
    tensors = pytree.tree_leaves((args, kwargs))
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    return any(is_dtensor(t) for t in tensors)


def has_capture_dtensor(tree) -> bool:
    return dtensor_class() is not None and any(
        is_capture_dtensor(x) for x in pytree.tree_leaves(tree))


# --- the prologue's step from a DTensor to its local tensor ------------------------------------

LOCAL = PathKind("local", lambda base, key: f"{base}._local_tensor",
                 lambda var, key: f"{var}._local_tensor",
                 lambda path: f"{path.parent.name_hint()}_local")


class GradPlacements:
    """The placements ``to_local()`` gives the local tensor's gradient, when they are not the
    DTensor's own (a replicated weight of a sharded batch gets a ``Partial`` gradient): set by
    ``dtensor_autograd`` once it has derived the gradient, read by the prologue's step."""

    def __init__(self):
        self.placements: tuple | None = None

    def argument(self) -> str:
        """``grad_placements=...`` as Python over ``torch`` (every trace's namespace has it)."""
        if self.placements is None:
            return ""
        return f"grad_placements=({''.join(_placement_source(p) + ', ' for p in self.placements)})"


def _placement_source(p) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard
    if type(p) is Replicate:
        return "torch.distributed.tensor.Replicate()"
    if type(p) is Shard:
        return f"torch.distributed.tensor.Shard({p.dim})"
    if type(p) is Partial:
        return f"torch.distributed.tensor.Partial({p.reduce_op!r})"
    raise ValueError(p)


def placements_have_source(placements) -> bool:
    try:
        [_placement_source(p) for p in placements]
    except ValueError:
        return False
    return True


TO_LOCAL = PathKind("to_local", lambda base, key: f"{base}.to_local({key.argument()})",
                    lambda var, key: f"{var}.to_local({key.argument()})",
                    lambda path: f"{path.parent.name_hint()}_local")


# --- the prologue's check of a DTensor's spec ---------------------------------------------------

SPEC = PathKind("spec", lambda base, key: f"{base}._spec", lambda var, key: f"{var}._spec",
                lambda path: f"{path.parent.name_hint()}_spec")


def _describe_spec(g) -> str:
    spec, requires_grad = g.expected
    return (f"{g.where} is a DTensor on {spec.mesh} with placements {spec.placements}, global "
            f"shape {tuple(spec.shape)}, stride {spec.stride}, {spec.tensor_meta.dtype} and "
            f"requires_grad {requires_grad}")


def _check_spec(b, g) -> None:
    spec, requires_grad = g.expected
    p = b.var(g.path)

    def condition(w):
        v = p.name
        cls = w.constant(dtensor_class(), "DTensor")
        expected = w.constant(spec, "spec")
        # A parameter keeps its spec object from call to call: identity first.
        return (f"type({v}) is not {cls} or {v}.requires_grad is not {requires_grad} or "
                f"({v}._spec is not {expected} and {v}._spec != {expected})")
    # About the spec, not the DTensor: the fast prologue checks it on every call, where a
    # check on a parameter's own path would run only when the module tree changes (and a
    # parameter's requires_grad changes without that).
    b.check(g.description, condition, g.from_module, guard=g, subject=Path(g.path, SPEC, "_spec"),
            uses=(p,))


DTENSOR_SPEC = GuardKind("dtensor spec", _describe_spec, _check_spec)


# --- inputs -------------------------------------------------------------------------------------

def dtensor_input(ctx, real, path: Path, tags=()) -> torch.Tensor:
    """The stand-in the program sees for the DTensor ``real`` found at ``path``: a DTensor with
    ``real``'s spec around the fake of its local tensor, which is the computation's input."""
    stand_ins = ctx.dtensors.stand_ins
    known = stand_ins.get(id(real))
    if known is not None:
        _, stand_in, first = known
        if first != path:  # the same DTensor reached two ways: it must be so on every call
            ctx.guard(guards.IDENTITY, path, _ReachedBefore(first))
        return stand_in
    with DisableTorchFunction():  # taking it in is not the program
        stand_in = _stand_in(ctx, real, path, tags)
    refuse_symbolic_sizes(ctx)
    stand_ins[id(real)] = (real, stand_in, path)  # the real one kept alive: its id stays its own
    return stand_in


@dataclass(frozen=True)
class _ReachedBefore:
    """What an identity guard compares with: the DTensor at ``path`` (read there first)."""

    path: Path
    proxy: Any = None
    fake: Any = None


def _stand_in(ctx, real, path: Path, tags):
    if type(real) is not dtensor_class():
        raise UnsupportedInputError(
            f"keraunos.jit: {path} is a {type(real).__qualname__}, a subclass of DTensor; "
            f"keraunos captures DTensor itself only.\n  What to do: pass a DTensor, or its "
            f"local tensor (.to_local()).")
    local = real._local_tensor
    if is_traceable_wrapper_subclass(local):
        raise UnsupportedInputError(
            f"keraunos.jit: {path} is a DTensor whose local tensor is a "
            f"{type(local).__qualname__}; keraunos captures DTensors of plain tensors only.")
    ctx.guard(DTENSOR_SPEC, path, (real._spec, real.requires_grad))
    cls = dtensor_class()
    if not (torch.is_grad_enabled() and real.requires_grad):
        fake_local = ctx.tensor_input(local, Path(path, LOCAL, "_local_tensor"), tags)
        return cls(fake_local, real._spec, requires_grad=real.requires_grad)
    # Gradients: the prologue's to_local() connects the local input to the user's DTensor (its
    # backward makes the local gradient a DTensor of the input's placements); the stand-in is a
    # leaf of its own, from which capture derives DTensor's backward (dtensor_autograd.py).
    ctx.dtensors.autograd = True
    with unset_fake_temporarily():
        real_local = real.to_local()  # what the prologue's to_local() gives: it requires grad
    ctx.dtensors.keep_alive.append(real_local)  # the prologue's check reads it, weakly
    grad_placements = GradPlacements()
    fake_local = ctx.tensor_input(real_local, Path(path, TO_LOCAL, grad_placements), tags)
    ctx.dtensors.grad_placements[ctx.proxy(fake_local).name] = grad_placements
    with ctx.fake_mode:
        inner = fake_local.detach()  # a DTensor's local tensor never requires grad itself
    ctx.proxy_of[id(inner)] = ctx.proxy(fake_local)
    stand_in = cls(inner, real._spec, requires_grad=True)
    ctx.dtensors.of_input[ctx.proxy(fake_local).name] = stand_in
    ctx.dtensors.keep_alive.append(inner)  # its id stays its own
    return stand_in


# --- calls --------------------------------------------------------------------------------------

class _LocalOps(TorchDispatchMode):
    """Lets every wrapper subclass dispatch its own ops (``NotImplemented``) and writes down
    the ops it then runs on plain tensors: DTensor's local ops and collectives, and also what
    its sharding propagation runs on fakes of its own to find shapes (sorted out later)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []  # (func, args, kwargs, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(x) for x in pytree.tree_leaves((args, kwargs))):
            return NotImplemented
        out = func(*args, **kwargs)
        if func._schema.is_mutable or any(isinstance(t, torch.Tensor)
                                          for t in pytree.tree_leaves(out)):
            self.calls.append((func, args, kwargs, out))
        return out


def refuse_symbolic_sizes(ctx) -> None:
    """DTensor programs are compiled for exact sizes: a DTensor's spec holds its global sizes
    as numbers, and the prologue checks them (keraunos then compiles with exact sizes)."""
    if ctx.dynamic is not None and ctx.dynamic.any_dynamic:
        raise SymbolicUnsupported("a DTensor program: compiled for exact sizes")


def record_dtensor_call(ctx, func, args, kwargs):
    """Run a torch call that has a DTensor argument; record the local ops DTensor runs for it.
    (Also every call of a program of DTensors under grad mode: ``record_aten``.)"""
    refuse_symbolic_sizes(ctx)
    if getattr(func, "__self__", None) in (torch.Tensor.grad, torch.Tensor._base) and \
            has_capture_dtensor(args):
        # The stand-in's own state is capture's, not the user's DTensor's (its .grad is None).
        raise CaptureError(
            f"keraunos cannot capture {user_source()}\n  it reads `.{func.__self__.__name__}` "
            f"of a DTensor inside the program, which keraunos does not capture.\n  What to do: "
            f"read it outside the jitted function and pass it in (p.grad is a DTensor of its "
            f"own), or step the optimizer outside the jitted function.")
    ctx.record_global_state()
    mode = _LocalOps()
    # Torch function off inside: DTensor's own Python (a Partial's division) is recorded once,
    # as the ATen op it dispatches, not again as a torch call.
    with DisableTorchFunction(), mode:
        out = func(*args, **kwargs)
    _refuse_distributed_random(mode.calls, args, kwargs)
    _emit_program_calls(ctx, mode.calls, user_source())
    for t in pytree.tree_leaves(out):
        if is_dtensor(t):
            ctx.proxy(t._local_tensor)  # every local result is a value the trace defines
        elif isinstance(t, torch.Tensor):
            ctx.proxy(t)
    return out


def _refuse_distributed_random(calls, args, kwargs) -> None:
    """On a mesh whose device has a generator state DTensor manages (CUDA), DTensor offsets the
    generator per shard around a random op (``OffsetBasedRNGTracker``): state changes capture
    would make once, on fakes. (On CPU meshes a random op draws from the local generator, which
    the trace replays as any random op.)"""
    seeded = torch.Tag.nondeterministic_seeded
    if not any(seeded in getattr(func, "tags", ()) for func, *_ in calls):
        return
    for t in pytree.tree_leaves((args, kwargs)):
        if is_dtensor(t):
            from torch.distributed.device_mesh import _get_device_handle
            handle = _get_device_handle(t.device_mesh.device_type)
            if handle is not None and hasattr(handle, "set_rng_state"):
                raise CaptureError(
                    f"keraunos cannot capture {user_source()}\n  a random op on DTensors of a "
                    f"{t.device_mesh.device_type} mesh: DTensor offsets the generator of each "
                    f"shard around it, which keraunos does not capture yet.\n  What to do: "
                    f"call the random op (dropout, an init) outside the jitted function.")


def _emit_program_calls(ctx, calls, source, backward: bool = False) -> None:
    """The calls that compute the program's values, as lines. A call that reads a value of the
    program is one. A call that reads none is held back: it is one when a call of the program
    later reads what it made (a factory's zeros), and otherwise it was sharding propagation
    finding a shape on fakes of its own, which the program never runs."""
    held: dict[int, list] = {}  # id(tensor) -> the held-back calls that made or wrote it

    def known(t) -> bool:
        return id(t) in ctx.proxy_of

    def emit(call) -> None:
        func, args, kwargs, out = call
        if is_lifted_constant(_AtenCall(func, args, kwargs, out)):
            _emit_line(ctx, call, source, backward)  # Python data, in a tensor of its own
            return
        for t in _tensors((args, kwargs)):
            if not known(t) and not _known_alias(ctx, t):
                chain = held.pop(id(t), None)
                if chain is None and backward:
                    raise CaptureError(
                        f"keraunos cannot capture this DTensor program with gradients: the "
                        f"backward's `{func}` reads a value made inside a torch call recorded "
                        f"before the program met its first DTensor.\n  What to do: make the "
                        f"tensors DTensors before that call, or call that part outside the "
                        f"jitted function.")
                if chain is None:
                    raise CaptureError(
                        f"keraunos: internal error: DTensor's `{func}` at {source} reads a "
                        f"tensor of unknown origin. Please report this with the program.")
                for c in chain:
                    emit(c)
        _emit_line(ctx, call, source, backward)

    for call in calls:
        func, args, kwargs, out = call
        if any(known(t) for t in _tensors((args, kwargs))):
            emit(call)
            continue
        for t in _tensors((args, kwargs, out)):
            held.setdefault(id(t), [])
            if call not in held[id(t)]:
                held[id(t)].append(call)


def _known_alias(ctx, t) -> bool:
    """Whether ``t`` is a new object over a value of the program (same memory, layout and
    dtype): autograd hands a saved output back so. If so, it is named as that value."""
    if not isinstance(t, FakeTensor):
        return False
    key = t.untyped_storage()._cdata
    for name, fake in ctx.fake_of.items():
        if (ctx.storage_of.get(name) == key and fake.dtype == t.dtype
                and fake.shape == t.shape and fake.stride() == t.stride()
                and fake.storage_offset() == t.storage_offset()):
            ctx.proxy_of[id(t)] = ctx.proxy_of[id(fake)]
            ctx.dtensors.keep_alive.append(t)  # its id stays its own
            return True
    return False


def _emit_line(ctx, call, source, backward: bool = False) -> None:
    func, args, kwargs, out = call
    outputs = pytree.tree_map(
        lambda t: ctx.output_proxy(t) if isinstance(t, torch.Tensor) else t, out)
    if is_lifted_constant(_AtenCall(func, args, kwargs, out)):
        ctx.emit(constant_line(args[0], outputs, source))
        return
    tags = {RANDOM} if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) else set()
    if func._schema.is_mutable and backward:
        tags.add(MUTATION)  # on the backward's own values (a forward value is refused)
        if any(id(t) in ctx.dtensors.forward_values for t in _tensors((args, kwargs))):
            raise CaptureError(f"keraunos cannot capture this DTensor program with gradients: "
                               f"its backward writes a value of the forward in place ({func}).")
    elif func._schema.is_mutable:
        tags.add(MUTATION)
        for t in _tensors((args, kwargs)):
            key = t.untyped_storage()._cdata
            ctx.mutated_storages.add(key)
            ctx.mutated_with_grad[key] = ctx.mutated_with_grad.get(key, False) or \
                torch.is_grad_enabled()
    p_args, p_kwargs = pytree.tree_map(lambda x: _trace_value(ctx, x, source), (args, kwargs))
    ctx.emit(BoundSymbol(TorchSymbol(func, f"torch.ops.{func}", "function"), tuple(p_args),
                         dict(p_kwargs), outputs, source, tags))


class _AtenCall:
    """The fields ``is_lifted_constant`` reads."""

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _trace_value(ctx, x, source):
    if isinstance(x, torch.Tensor):
        return ctx.proxy(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if ctx.backed(x):
            return ctx.symbols.code(x)
        raise CaptureError(f"keraunos cannot capture {source}\n  a DTensor op there has a "
                           f"size that depends on tensor data.")
    return x


# --- results ------------------------------------------------------------------------------------

def rebuild_dtensor(local: torch.Tensor, spec) -> torch.Tensor:
    """The DTensor the program returned, around the computation's local result."""
    cls = dtensor_class()
    if local.requires_grad:  # connected to autograd as from_local connects it
        return cls.from_local(local, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)
    return cls(local, spec, requires_grad=False)
