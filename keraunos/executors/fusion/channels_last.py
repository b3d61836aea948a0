"""Whether a region's graph is laid out channels-last: Inductor's choice on CPU, or not.

Inductor on CPU lays out every graph holding a convolution channels-last (``GraphLowering.
decide_layout_opt``: with mkldnn, always). Within one whole-model graph the activations stay
channels-last from one convolution to the next; a region is a graph of its own, whose inputs and
outputs keep eager's layout (the trace's strides), so every call of a region copies its input
activations and its convolution weights into channels-last, and its outputs back. Measured on
torchvision's models (docs/benchmarks.md, "Vision"), batch 2:

- dense convolutions (resnet18): the copies cost more than channels-last gains; with
  ``layout_optimization`` off the regions call the same NCHW kernels eager calls, and resnet18's
  eval call went from 1.03-1.27x torch.compile's to 0.62-0.69x;
- grouped (depthwise) convolutions (mobilenet_v3_small, efficientnet_b0): eager's NCHW kernels
  are the slow ones, and channels-last pays for its copies (eval 0.89-0.94x with it, 1.33-1.35x
  without).

So a region whose convolutions are all dense is compiled with ``layout_optimization`` off; any
other region keeps Inductor's default. ``torch._inductor.config.patch`` is thread-local in torch
2.13 (the background tier compiles on its own thread), and the choice is part of the region's key.
"""
from __future__ import annotations

import contextlib

import torch

from ...core.proxies import TensorProxy
from ...core.symbols import BoundSymbol, TorchSymbol

# Convolutions a region may hold whose weight is (out, in / groups, *kernel): by id.
_CONVOLUTIONS = {id(f): f for f in (
    torch.conv1d, torch.conv2d, torch.conv3d, torch.nn.functional.conv1d,
    torch.nn.functional.conv2d, torch.nn.functional.conv3d)}


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
    """False where the region's convolutions are all dense (see above); None (Inductor's
    default) otherwise, and for regions without convolutions."""
    kinds = [k for k in map(_is_dense_convolution, lines) if k is not None]
    return False if kinds and all(kinds) else None


@contextlib.contextmanager
def inductor_layout(choice: bool | None):
    """Inductor's ``layout_optimization`` set to ``choice`` in this thread (None: unchanged)."""
    if choice is None:
        yield
        return
    from torch._inductor import config
    with config.patch(layout_optimization=choice):
        yield
