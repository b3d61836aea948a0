"""Record the joint forward and backward of a computation, at the ATen level, on fake tensors.

The computation trace is interpreted line by line on fake tensors that require grad where its
inputs do, under a ``TorchDispatchMode`` that records every ATen op and which torch-level line it
came from. Then ``torch.autograd.grad`` of the differentiable outputs runs on the same fakes under
the same mode: what it records is PyTorch's own derivative formulas, op by op. Nothing here is
ours but the bookkeeping, so every op with a derivative in PyTorch works.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.autograd_graph import leaves_reached
from ..core.symbolic import SymbolicValue
from ..core import glue
from ..core.aten import AtenCall, AtenRecorder
from ..core.effects import METADATA_WRITES
from ..core.interpreter import SKIP, Interpreter
from ..core.proxies import NumberProxy, TensorProxy
from ..core.symbols import TorchSymbol
from ..core.trace import Trace
from ..capture.state import global_state, restore_global_state, switch_global_state
from ..torch_internals.fake import FakeTensorMode, ShapeEnv
from .rules import rule_for


@dataclass
class Joint:
    inputs: list[torch.Tensor]                 # fakes of the computation's params, in order
    env: dict[str, Any]                        # proxy name -> fake, after the forward
    forward_calls: list[AtenCall]
    backward_calls: list[AtenCall]
    outputs: list[torch.Tensor]                # fakes of the computation's flat outputs
    output_proxies: list[TensorProxy]
    differentiable: list[int]                  # indices into outputs that get a gradient
    grad_outputs: list[torch.Tensor]           # fakes standing for those gradients
    needs_grad: list[int]                      # indices into inputs that get a gradient
    grads: list[Any]                           # fakes of those gradients (None when unused)
    keep_alive: list = field(default_factory=list)  # the fake mode, while its fakes are in use
    # input index -> positions in ``differentiable`` of the outputs whose autograd graph reaches
    # that input: eager's backward reaches an input only from outputs that got a gradient.
    reached_from: dict[int, set[int]] = field(default_factory=dict)
    # (name, fake): the fakes a name stood for before and after an in-place metadata change of a
    # view (``x.t_()``, run on fakes as its functional view, see _FakeForward.run_line).
    rebound: list = field(default_factory=list)


def _is_differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (
        t.dtype.is_floating_point or t.dtype.is_complex)


def _shape_env_of(computation: Trace):
    """The capture's ``ShapeEnv`` when the computation has symbolic sizes: the backward is
    recorded on the same symbols, so the guards its formulas add reach the prologue too."""
    for p in computation.params:
        if isinstance(p, NumberProxy) and p.value is not None:
            return p.value.node.shape_env
    return None


class _FakeForward(Interpreter):
    """The computation on fake tensors, under the recorder: each torch-level line runs (or our
    derivative rule for it), with the recorder's ``parent`` set to its index."""

    def __init__(self, env, recorder):
        super().__init__(env)
        self.recorder = recorder
        self.outputs: list[TensorProxy] = []
        self.rebound: list[tuple[str, Any]] = []  # (name, fake) of each in-place metadata change

    def constant(self, x):
        return x.value if isinstance(x, SymbolicValue) else x  # a symbolic size: its SymInt

    def run_line(self, index, bsym, args, kwargs):
        symbol = bsym.symbol
        if isinstance(symbol, TorchSymbol):
            if any(symbol.fn is f for f in _RNG_STATE):
                # Never touch the real generator while compiling; the trace runs these.
                if symbol.fn is torch.get_rng_state:
                    return torch.empty(bsym.outputs.shape, dtype=bsym.outputs.dtype)
                return SKIP
            if symbol.attribute is torch.Tensor.grad:
                # The fake inputs have no .grad; the real ones have what capture saw.
                return _fake_like(bsym.outputs)
            self.recorder.parent = index
            functional = METADATA_WRITES.get(symbol.fn)
            if functional is not None and args and _is_tracked_view(args[0]):
                # x.t_() of a view: on fakes, autograd replays views from their view functions,
                # which miss in-place metadata changes (a later write through x[..., :1] would
                # get the gradient of the untransposed slice). The functional view is the same
                # memory and metadata, and autograd tracks it exactly; the trace keeps x.t_().
                # The name now stands for another fake: the one it stood for is remembered, so
                # that what earlier lines made from it is still named (see ``rebound``).
                name = bsym.args[0].name
                self.rebound.append((name, self.env[name]))
                self.env[name] = functional(*args, **kwargs)
                self.rebound.append((name, self.env[name]))
                return SKIP
            out = rule_for(symbol.fn)(*args, **kwargs)
            return SKIP if symbol.style == "setitem" else out
        if symbol is glue.RETURN:
            self.outputs = list(bsym.args[0])
        elif symbol is glue.SET_GLOBAL_STATE:
            _apply_state(bsym)
        else:
            raise NotImplementedError(f"line of {symbol.name} in an autograd computation")
        return SKIP

    def bind_name(self, name, value):
        # An in-place op's output keeps the name of the input the capture saw (``x`` for
        # ``x.clamp_()`` even when the line writes the working copy ``x_updated``): a name
        # already bound keeps its value, or the input's fake would be lost.
        self.env.setdefault(name, value)


def record_joint(computation: Trace) -> Joint:
    shape_env = _shape_env_of(computation)
    mode = FakeTensorMode(shape_env=shape_env or ShapeEnv(), static_shapes=shape_env is None)
    recorder = AtenRecorder()
    env: dict[str, Any] = {}
    inputs = []
    with mode:
        for p in computation.params:
            if isinstance(p, NumberProxy):  # a symbolic size: the SymInt capture gave it
                env[p.name] = p.value
                inputs.append(p.value)
                continue
            t = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=p.device)
            if p.requires_grad:
                t.requires_grad_(True)
            env[p.name] = t
            inputs.append(t)
    forward = _FakeForward(env, recorder)
    state = global_state()  # grad mode and autocast, which the program's switches change
    try:
        with torch.enable_grad(), mode, recorder:
            forward.run(computation.bound_symbols)
            recorder.parent = None
            outputs = [env[p.name] for p in forward.outputs]
            differentiable = [i for i, o in enumerate(outputs) if _is_differentiable(o)]
            needs_grad = [i for i, t in enumerate(inputs) if getattr(t, "requires_grad", False)]
            recorder_calls_forward = list(recorder.calls)
            recorder.calls = []
        with mode:
            grad_outputs = [torch.empty_like(outputs[i], requires_grad=False) for i in differentiable]
        # The backward as autograd runs it outside autocast (where PyTorch asks for backward to
        # be called): its casts are autograd's own. Called under autocast, its ATen calls meet
        # autocast as eager's do.
        for device in glue.AUTOCAST_DEVICES:
            torch.set_autocast_enabled(device, False)
        with torch.enable_grad(), mode, recorder:
            grads = list(torch.autograd.grad([outputs[i] for i in differentiable],
                                             [inputs[i] for i in needs_grad], grad_outputs,
                                             allow_unused=True)) if differentiable else \
                [None] * len(needs_grad)
    finally:
        restore_global_state(state)
    return Joint(inputs, env, recorder_calls_forward, _reshapes(recorder.calls), outputs,
                 forward.outputs,
                 differentiable, grad_outputs, needs_grad, grads, keep_alive=[mode],
                 reached_from=_reached_from(inputs, [outputs[i] for i in differentiable]),
                 rebound=forward.rebound)


_VIEW, _RESHAPE = torch.ops.aten.view.default, torch.ops.aten.reshape.default


def _reshapes(calls: list[AtenCall]) -> list[AtenCall]:
    """The backward's ``view`` calls as ``reshape``, where nothing writes their memory.

    A derivative formula reshapes (``grad.reshape(sizes)``, the backward of every ``view``),
    and ATen's ``reshape`` becomes a ``view`` when the recorded (fake) tensor's strides allow
    it. Fake kernels do not always give eager's strides: ``softplus_backward``'s meta kernel
    makes a contiguous tensor where the CPU kernel keeps its input's transposed layout, and the
    ``view`` recorded for it fails at run time (Mamba's training step). ``reshape`` is the same
    view wherever the view works and a copy where it would fail; a view whose memory some call
    writes keeps its aliasing (the write must reach, or come through, the view)."""
    written = set()
    for c in calls:
        schema = c.func._schema
        if not schema.is_mutable:
            continue
        for i, argument in enumerate(schema.arguments):
            value = c.args[i] if i < len(c.args) else c.kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write and \
                    isinstance(value, torch.Tensor):
                written.add(_storage(value))
    return [AtenCall(_RESHAPE, c.args, c.kwargs, c.out, c.parent)
            if c.func is _VIEW and _storage(c.args[0]) not in written else c for c in calls]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _reached_from(inputs: list, outputs: list) -> dict[int, set[int]]:
    """For each input that requires grad, the outputs (by position) whose autograd graph
    reaches it. Data flow in the backward trace cannot tell this: the gradient ``copy_`` leaves
    for what it overwrote is zeros that read no incoming gradient, and must still be None when
    only outputs that got no gradient lead there (eager never runs that path)."""
    index_of = {id(t): i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
    reached: dict[int, set[int]] = {}
    ids = set(index_of)
    for position, out in enumerate(outputs):
        for leaf in leaves_reached(out, ids):  # an input returned as it is, too
            reached.setdefault(index_of[leaf], set()).add(position)
    return reached




def _is_tracked_view(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t._is_view()


def _fake_like(proxy):
    if not isinstance(proxy, TensorProxy):
        return None
    return torch.empty_strided(proxy.shape, proxy.stride, dtype=proxy.dtype, device=proxy.device)


# The generator's functions capture records (``capture/interceptors.py``), as the originals
# (read when keraunos is imported, before any capture swaps them for its recorders).
_RNG_STATE = (torch.manual_seed, torch.get_rng_state, torch.set_rng_state)


def _apply_state(bsym) -> None:
    """A switch of grad mode or autocast the program makes, made on the fake run (capture wrote
    autocast's casts as lines, which the switch then leaves as they are; a line it could not
    write, ``UNDER_AUTOCAST``, casts as it did in capture)."""
    switch_global_state(bsym.args[0])
