"""Which layout each convolution of a fused region runs in: keraunos's choice per convolution.

Inductor on CPU lays out every graph holding a convolution channels-last (``GraphLowering.
decide_layout_opt``: with mkldnn, always). Within one whole-model graph the activations stay
channels-last from one convolution to the next; a region is a graph of its own, whose inputs and
outputs keep eager's layout (the trace's strides), so under Inductor's choice every call of a
region copies its input activations and its convolution weights into channels-last, and its
outputs back (in training: every activation the forward saves for the backward). Measured on
torchvision's models (docs/benchmarks.md, "The model zoo and torchvision"), batch 2, one
intra-op thread:

- dense convolutions (resnet18): the copies cost more than channels-last gains; in eager's
  layout the regions call the kernels eager calls (resnet18's eval call went from 1.03-1.27x
  torch.compile's to 0.62-0.69x);
- grouped (depthwise) convolutions: ATen's mkldnn kernel runs their forward 1.4-2.6x faster on
  channels-last tensors, and their backward as fast or faster in eager's layout (a 5x5 one at
  1152 channels, 2x2 pixels: 0.8 ms against 1.8 ms);
- 1x1 convolutions of stride 1 that ATen runs on its ``_slow_conv2d`` path (CPU, float32, one
  intra-op thread, a batch under 16: ``ConvParams::use_mkldnn`` leaves them there): in eager's
  layout that is one matrix product per image with as many columns as the image has pixels,
  and at 2x2 pixels it runs 2-3x slower than the same product on channels-last tensors
  (forward, 1152 to 192 channels: 110 against 45 us with the copies; backward 250 against
  130 us). At 4x4 pixels the forward is 1.2-1.6x faster in eager's layout and the backward
  1.1-1.6x faster channels-last (the kernels alone); from 8x8 up neither wins by much once
  the copies are counted. In
  efficientnet_b0's training step, relaying the backward up to 16 or 64 pixels measured
  0.5-1.5% faster than up to 4, and up to 1024 slower. Matrix products of our own
  (``torch.matmul`` per image, ``bmm``) and Inductor's ``conv_1x1_as_mm`` were slower or no
  faster.

So a region whose every convolution keraunos places itself is not handed to Inductor's layout
optimization (``layout_optimization`` off): it keeps eager's layout, and the convolutions that
gain run on channels-last copies made inside the region's graph (``aten.clone`` with a
``memory_format``, which Inductor may write from the kernel that makes the value), their
results copied back to eager's layout:

- forward: a grouped 2-D convolution, and a 1x1 stride-1 unpadded one on the ``_slow_conv2d``
  path whose images have 2 to ``FORWARD_PIXELS`` pixels;
- backward: ``aten.convolution_backward`` of such a 1x1 convolution whose images have 2 to
  ``BACKWARD_PIXELS`` pixels (the grouped ones' backward stays in eager's layout).

Only tensors the trace records in eager's contiguous layout are relaid (a program already
channels-last is left as it is), and only on the CPU. Inductor's ``config.patch`` is
thread-local in torch 2.13 (the background tier compiles on its own thread), and the choice is
part of the region's key; the copies are in the region's graph, and so in its key too.
"""
from __future__ import annotations

import contextlib
import operator

import torch

from ...core.proxies import TensorProxy
from ...core.symbols import BoundSymbol, TorchSymbol

# Convolutions a region may hold whose weight is (out, in / groups, *kernel): by id.
_CONVOLUTIONS = {id(f): f for f in (
    torch.conv1d, torch.conv2d, torch.conv3d, torch.nn.functional.conv1d,
    torch.nn.functional.conv2d, torch.nn.functional.conv3d)}
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default
_CLONE = torch.ops.aten.clone.default

# The largest image of a 1x1 convolution, in pixels, that runs channels-last (above: 2x2 in the
# forward, up to 4x4 in the backward).
FORWARD_PIXELS = 4
BACKWARD_PIXELS = 16


def _is_dense_convolution(bsym: BoundSymbol) -> bool | None:
    """True for a convolution with one group, False for a grouped one, None for other lines."""
    symbol = bsym.symbol
    if not isinstance(symbol, TorchSymbol) or id(symbol.fn) not in _CONVOLUTIONS:
        return None
    x, weight = (bsym.args + (None, None))[:2]
    if not (isinstance(x, TensorProxy) and isinstance(weight, TensorProxy)):
        return False  # (not known: keep Inductor's default)
    channels = x.shape[-len(weight.shape) + 1]  # (N,) C, *spatial, or unbatched C, *spatial
    return type(channels) is int and channels == weight.shape[1]


def layout_optimization(lines: list[BoundSymbol]) -> bool | None:
    """False (eager's layout, convolutions relaid one by one: see above) for a region each of
    whose convolutions is dense or relaid by ``relaid_line``; None (Inductor's default) for
    one holding another grouped convolution (on a GPU, of symbolic sizes, not float32), and
    for regions without convolutions."""
    kinds = [(dense, b) for b in lines if (dense := _is_dense_convolution(b)) is not None]
    if not kinds:
        return None
    return False if all(dense or _forward_runs_channels_last(b) for dense, b in kinds) else None


@contextlib.contextmanager
def inductor_layout(choice: bool | None):
    """Inductor's ``layout_optimization`` set to ``choice`` in this thread (None: unchanged)."""
    if choice is None:
        yield
        return
    from ...torch_internals.inductor import config
    with config.patch(layout_optimization=choice):
        yield


def relaid_line(graph, bsym: BoundSymbol, args: tuple, kwargs: dict):
    """The FX nodes of a convolution line that runs channels-last (see above): its result, or
    for ``convolution_backward`` the tuple of its three results (None where the line makes
    none); None for any other line, which the caller builds as it is."""
    if _forward_runs_channels_last(bsym):
        x = graph.call_function(_CLONE, (args[0],), {"memory_format": torch.channels_last})
        y = graph.call_function(bsym.symbol.fn, (x, *args[1:]), kwargs)
        return graph.call_function(_CLONE, (y,), {"memory_format": torch.contiguous_format})
    if _backward_runs_channels_last(bsym):
        grad, x = (graph.call_function(_CLONE, (a,), {"memory_format": torch.channels_last})
                   for a in args[:2])
        results = graph.call_function(bsym.symbol.fn, (grad, x, *args[2:]), kwargs)
        items = [None if p is None else graph.call_function(operator.getitem, (results, k))
                 for k, p in enumerate(bsym.outputs)]
        if items[0] is not None:  # the input's gradient, back in eager's layout
            items[0] = graph.call_function(_CLONE, (items[0],),
                                           {"memory_format": torch.contiguous_format})
        return tuple(items)
    return None


def _forward_runs_channels_last(bsym: BoundSymbol) -> bool:
    dense = _is_dense_convolution(bsym)
    if dense is None or len(bsym.args) < 2 or bsym.symbol.style != "function":
        return False
    x, weight = bsym.args[:2]
    (out,) = bsym.output_proxies() or (None,)
    if not _eager_layout_2d(x, out) or not isinstance(weight, TensorProxy) or \
            x.dtype != torch.float32:
        return False
    if not dense:
        return True
    return _on_slow_conv2d(x, weight) and 1 < _pixels(out) <= FORWARD_PIXELS and \
        tuple(out.shape[2:]) == tuple(x.shape[2:])  # (a 1x1 kernel: stride 1, no padding)


def _backward_runs_channels_last(bsym: BoundSymbol) -> bool:
    if getattr(bsym.symbol, "fn", None) is not _CONVOLUTION_BACKWARD or len(bsym.args) != 11 \
            or bsym.kwargs or not isinstance(bsym.outputs, (tuple, list)) \
            or len(bsym.outputs) != 3:
        return False
    grad, x, weight, _, stride, padding, _, transposed, _, groups, _ = bsym.args
    grad_input = bsym.outputs[0]
    return (_eager_layout_2d(x, grad) and isinstance(weight, TensorProxy) and groups == 1
            and not transposed and tuple(stride) == (1, 1) and tuple(padding) == (0, 0)
            and _on_slow_conv2d(x, weight) and 1 < _pixels(x) <= BACKWARD_PIXELS
            and (grad_input is None or _eager_layout_2d(grad_input)))


def _on_slow_conv2d(x: TensorProxy, weight: TensorProxy) -> bool:
    """A 1x1 convolution that ATen's CPU heuristics run on ``_slow_conv2d`` (``use_mkldnn``:
    one thread, a batch under 16), in float32."""
    return (tuple(weight.shape[2:]) == (1, 1) and weight.shape[1] == x.shape[1]
            and x.dtype == torch.float32 and x.shape[0] < 16 and torch.get_num_threads() == 1)


def _eager_layout_2d(*tensors) -> bool:
    """Batched 2-D images of static sizes on the CPU, laid out contiguously."""
    for t in tensors:
        if not isinstance(t, TensorProxy) or len(t.shape) != 4 or \
                torch.device(t.device).type != "cpu" or \
                not all(type(n) is int for n in (*t.shape, *t.stride)):
            return False
        if not torch.empty_strided(t.shape, t.stride, device="meta").is_contiguous():
            return False
    return True


def _pixels(t: TensorProxy) -> int:
    return t.shape[2] * t.shape[3]
