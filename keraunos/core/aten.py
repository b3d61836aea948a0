"""Recording ATen calls: the one ``TorchDispatchMode`` that writes down what ran below the torch level.

Both the joint forward-and-backward recording (``autograd/joint.py``) and the capture of a
``torch.vmap``-ed function (``capture/calls.py``, ``record_vmap``) need to see ATen ops, because what they record
never reaches the torch function level: PyTorch's derivative formulas, functorch's batching rules.
The recorder lives here so that neither of those layers imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..torch_internals.dispatch import DisableTorchFunction
from ..torch_internals.fake import FakeTensor, suggest_memory_format
from .symbols import BoundSymbol, TorchSymbol


@dataclass
class AtenCall:
    """One ATen op that ran; ``parent`` is the index of the torch-level line (in the computation
    trace) it belongs to, ``None`` where no line is its parent (the backward, a vmapped body)."""

    func: Any
    args: tuple
    kwargs: dict
    out: Any
    parent: int | None


class AtenRecorder(TorchDispatchMode):
    """Runs every ATen op as it comes and appends it to ``calls``, tagged with ``parent``."""

    def __init__(self):
        super().__init__()
        self.calls: list[AtenCall] = []
        self.parent: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _BATCH_NORM_OPS:
            out = eager_batch_norm_layout(args, out)
        # Queries that make no tensor and change nothing (prim.device, sym_size) need no line.
        if func._schema.is_mutable or any(isinstance(t, torch.Tensor)
                                          for t in pytree.tree_leaves(out)):
            self.calls.append(AtenCall(func, args, kwargs, out, self.parent))
        return out


# Batch normalization: eager's CPU kernel lays its output out in the input's suggested memory
# format (contiguous for a transposed ``(N, C)`` input), where the fake kernel keeps the input's
# strides. Recorded with eager's layout (here and at the torch level, ``capture/recorder.py``),
# which a region's output is then given too.
_BATCH_NORM_OPS = frozenset((torch.ops.aten.native_batch_norm.default,
                             torch.ops.aten._native_batch_norm_legit.default,
                             torch.ops.aten._native_batch_norm_legit.no_stats,
                             torch.ops.aten._native_batch_norm_legit_no_training.default,
                             torch.ops.aten._native_batch_norm_legit_functional.default))


def eager_batch_norm_layout(args, out):
    """A batch normalization's outputs with its first laid out as eager's CPU kernel lays it."""
    x = args[0] if args else None
    if not isinstance(x, FakeTensor) or x.device.type != "cpu":
        return out
    first = out[0] if isinstance(out, tuple) else out
    layout = suggest_memory_format(x)
    if not isinstance(first, FakeTensor) or first.is_contiguous(memory_format=layout):
        return out
    first = first.contiguous(memory_format=layout)
    return (first, *out[1:]) if isinstance(out, tuple) else first


_LIFT_FRESH = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def is_lifted_constant(call: AtenCall) -> bool:
    """``torch.tensor(2.0)`` (also inside a vmapped function, or indexing with a list inside
    ``__getitem__``) reaches dispatch as ``lift_fresh`` of a real tensor holding the Python data:
    a constant the program makes, not an input."""
    const = call.args[0] if call.args else None
    return (call.func in _LIFT_FRESH and isinstance(const, torch.Tensor)
            and not isinstance(const, FakeTensor) and const.numel() <= 64)


def constant_line(const: torch.Tensor, output, source=None) -> BoundSymbol:
    """The line that makes the constant again, as the user wrote it: ``torch.tensor(data)``."""
    with DisableTorchFunction():
        data = const.tolist()
    kwargs = {"dtype": const.dtype}
    if const.device.type != "cpu":
        kwargs["device"] = const.device
    return BoundSymbol(TorchSymbol(torch.tensor, "torch.tensor", "function"), (data,), kwargs,
                       output, source, set())
