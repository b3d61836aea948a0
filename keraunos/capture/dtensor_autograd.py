"""Gradients of a DTensor program: DTensor's own backward, recorded as local ops at capture.

DTensor's autograd runs on the distributed tensors, not on their local tensors: ``from_local``'s
backward redistributes a ``Partial`` gradient to ``Replicate`` (an all-reduce), and a
redistribution DTensor makes inside an op has no backward of its own (a replicated bias made
``Partial`` is divided by the mesh size in the forward; its gradient is not). The derivative of
the local program capture records is therefore not the local part of DTensor's derivative, and
keraunos's autograd split, which differentiates the computation line by line, must not derive it.

So capture derives it the way PyTorch does under ``torch.compile`` (AOTAutograd's subclass
desugaring): after the program ran on the stand-in DTensors, ``torch.autograd.grad`` runs from
its outputs (each with a gradient of the output's spec, ``Partial`` made ``Replicate`` as
``from_local`` hands it back) to its inputs, on the same fakes, and the local ops and collectives
DTensor's backward runs are recorded (``dtensor._LocalOps``). The computation is then one line,
``dtensor_program(...)``, a ``torch.autograd.Function`` whose forward is the recorded forward and
whose backward is the recorded backward. The autograd split runs it like any line with a
derivative of its own: the forward trace gets the forward's lines (when the backward reads a value
made inside it) and the backward trace the backward's, collectives included.

The prologue connects the inputs to the user's autograd graph with ``w.to_local()`` (whose
backward wraps the local gradient as a DTensor of ``w``'s placements), and the epilogue its
DTensor results with ``from_local`` (``dtensor.rebuild_dtensor``).
"""
from __future__ import annotations

import torch

from ..torch_internals.dispatch import DisableTorchFunction
from ..core.autograd_graph import leaves_reached
from ..core import glue
from ..core.symbols import BoundSymbol, TorchSymbol
from ..core.tags import RANDOM
from ..core.trace import Trace
from ..errors import CaptureError
from . import dtensor


def _refuse(what: str) -> CaptureError:
    return CaptureError(
        f"keraunos cannot capture this DTensor program with gradients: {what}.\n  What to do: "
        f"run it under torch.no_grad(), or train it without keraunos.jit "
        f"(torch.compile(model, backend=\"keraunos\") runs the graphs it cannot compile eagerly).")


def _normalized(placements) -> tuple:
    """The placements ``to_local`` and ``from_local`` give a gradient: ``Partial`` made
    ``Replicate``."""
    from torch.distributed.tensor.placement_types import Partial, Replicate
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _gradient_spec(spec):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    return DTensorSpec(spec.mesh, _normalized(spec.placements), tensor_meta=spec.tensor_meta)


def region_line(ctx, params: list, forward_lines: list[BoundSymbol], returns) -> BoundSymbol:
    """The computation of a DTensor program with gradients as one line (see the module)."""
    dtensor.refuse_symbolic_sizes(ctx)
    if any(ctx.storage_of[e.proxy.name] in ctx.mutated_storages for e in ctx.inputs):
        raise _refuse("it writes a tensor in place")  # one it was passed (its own are fine)
    if ctx.replayed_calls:
        raise _refuse("it prints or logs (keraunos replays those after the program)")
    outputs = list(returns.flat)
    values, tangents, differentiable = [], [], []
    with ctx.fake_mode, DisableTorchFunction():
        for i, p in enumerate(outputs):
            value = returns.dtensor_of.get(p.name)
            fake = ctx.fake_of[p.name]
            if value is None:
                value = fake
            if not (value.requires_grad and value.dtype.is_floating_point):
                continue
            local = torch.empty_like(fake)
            tangent = local
            if dtensor.is_dtensor(value):
                tangent = dtensor.dtensor_class()(local, _gradient_spec(value._spec),
                                                  requires_grad=False)
            ctx.output_proxy(local)
            values.append(value)
            tangents.append((tangent, local))
            differentiable.append(i)
    leaves = [(j, ctx.dtensors.of_input.get(p.name, ctx.fake_of.get(p.name)))
              for j, p in enumerate(params)]
    leaves = [(j, leaf) for j, leaf in leaves if leaf is not None and leaf.requires_grad]
    _refuse_partial_reach(values, [leaf for _, leaf in leaves])
    backward_lines, grads = _record_backward(ctx, values, [t for t, _ in tangents],
                                             [leaf for _, leaf in leaves])
    grad_of = {}
    for (j, leaf), g in zip(leaves, grads):
        if g is None:
            continue
        if dtensor.is_dtensor(g):
            _hand_back(ctx, params[j].name, leaf, g)
            g = g._local_tensor
        grad_of[j] = ctx.proxy(g)
    tangent_proxies = [ctx.proxy(local) for _, local in tangents]
    return _program_line(ctx, params, forward_lines, outputs, differentiable, tangent_proxies,
                         backward_lines, [grad_of.get(j) for j in range(len(params))])


def _hand_back(ctx, name: str, leaf, grad) -> None:
    """The prologue's ``to_local()`` of input ``name`` hands its gradient back to the user's
    DTensor with the placements DTensor's backward gave it (as eager's ``.grad`` has them)."""
    placements = tuple(grad.placements)
    if placements == _normalized(leaf.placements):
        return  # to_local's own
    holder = ctx.dtensors.grad_placements.get(name)
    local, grad_local = leaf._local_tensor, grad._local_tensor
    # to_local's backward takes a gradient of the local tensor's own shape: a gradient sharded
    # otherwise than its input (an implicit redistribution has no backward) cannot pass.
    if holder is None or grad.shape != leaf.shape or grad.device_mesh != leaf.device_mesh or \
            grad_local.shape != local.shape or grad_local.dtype != local.dtype or \
            not dtensor.placements_have_source(placements):
        raise _refuse(f"the gradient of {name} is a DTensor with placements {placements}, "
                      f"where its input has {tuple(leaf.placements)}: keraunos hands a gradient "
                      f"back through to_local(), which takes a local gradient of the input's "
                      f"own shape")
    holder.placements = placements


def _refuse_partial_reach(values, leaves) -> None:
    """The program is one autograd node: every input it differentiates gets a gradient whenever
    one of its outputs does. Eager leaves None where only outputs that got no gradient lead, so
    outputs that reach different inputs are refused rather than given zeros."""
    ids = {id(leaf) for leaf in leaves}
    reaches = [leaves_reached(value, ids) for value in values]
    if any(r != reaches[0] for r in reaches[1:]):
        raise _refuse("its outputs' gradients reach different inputs (eager leaves the "
                      "gradient of an input None when no output leading to it gets one); return "
                      "the outputs from separate jitted functions, or one output")


def _record_backward(ctx, values, tangents, leaves):
    """``torch.autograd.grad`` of the program on the fakes, its local ops recorded as lines."""
    mode = dtensor._LocalOps()
    with ctx.fake_mode, DisableTorchFunction(), torch.enable_grad(), mode:
        grads = torch.autograd.grad(values, leaves, tangents, allow_unused=True) \
            if values and leaves else [None] * len(leaves)
    forward_lines, ctx.bound_symbols = ctx.bound_symbols, []
    ctx.dtensors.forward_values = set(ctx.proxy_of)  # ids of the forward's fakes: the backward reads them
    try:
        dtensor._emit_program_calls(ctx, mode.calls, None, backward=True)
        lines = ctx.bound_symbols
    finally:
        ctx.bound_symbols = forward_lines
    return lines, grads


def _program_line(ctx, params, forward_lines, outputs, differentiable, tangents,
                  backward_lines, grads) -> BoundSymbol:
    produced = {p.name for b in backward_lines for p in b.output_proxies()}
    tangent_names = {p.name for p in tangents}
    saved, seen = [], set()
    for b in backward_lines:
        for p in b.input_proxies():
            if p.name not in produced and p.name not in tangent_names and p.name not in seen:
                seen.add(p.name)
                saved.append(p)
    for g in grads:  # a gradient that is a forward value (a tangent passed straight through is
        if g is not None and g.name not in produced and g.name not in tangent_names \
                and g.name not in seen:  # one of the tangents)
            seen.add(g.name)
            saved.append(g)
    # Inside the Function's forward grad mode is off anyway; its own switches would turn it on.
    body = [b for b in forward_lines if not _switches_grad_mode(b)]
    forward = Trace("dtensor_forward", list(params),
                    body + [glue.RETURN.bind(outputs + saved)],
                    ["Constructed by capture: the forward of a DTensor program"])
    backward = Trace("dtensor_backward", saved + list(tangents),
                     backward_lines + [glue.RETURN.bind(grads)],
                     ["Constructed by capture: DTensor's backward of the program, as local ops"])
    program = DTensorProgram(forward, backward, len(outputs), differentiable)
    # A random draw inside keeps the line's place and count (the split then tags only the
    # drawing lines of the forward it lowers).
    tags = {RANDOM} if any(RANDOM in b.tags for b in body) else set()
    return BoundSymbol(TorchSymbol(program, "dtensor_program", "opaque"), tuple(params), {},
                       tuple(outputs), tags=tags,
                       comment="forward and backward recorded through DTensor")


def _switches_grad_mode(b: BoundSymbol) -> bool:
    if b.symbol is not glue.SET_GLOBAL_STATE:
        return False
    if any(i != 0 for i, _ in b.args[0]):
        raise _refuse("it switches autocast inside")
    return True


class DTensorProgram:
    """The computation of a DTensor program with gradients: called with the local inputs, it
    returns the local outputs through ``_DTensorProgramFunction``."""

    def __init__(self, forward: Trace, backward: Trace, n_outputs: int, differentiable):
        self.forward_trace, self.backward_trace = forward, backward
        self.forward = forward.python_callable()
        self.backward = backward.python_callable()
        self.n_outputs = n_outputs
        self.differentiable = list(differentiable)
        self.__name__ = "dtensor_program"

    def __call__(self, *inputs):
        return _DTensorProgramFunction.apply(self, *inputs)


class _DTensorProgramFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program, *inputs):
        results = program.forward(*inputs)
        outputs, saved = results[:program.n_outputs], results[program.n_outputs:]
        ctx.program, ctx.saved = program, saved
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outputs)
                                      if i not in program.differentiable])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        program = ctx.program
        return (None, *program.backward(*ctx.saved,
                                        *[grads[i] for i in program.differentiable]))
