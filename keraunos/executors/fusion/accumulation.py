"""Reductions in a region's graph accumulated as eager's CPU kernels accumulate them.

Inductor's CPU reductions keep float32 accumulators, one per output lane, and add the reduced
values to them in order. Eager's CPU kernels sum float32 data in a cascade or in float64 (an
``acc_type`` of double): on long or deep reductions the fused program's error against float64
grew to many times eager's. Two kinds of line are rebuilt in float64 on the way into the graph,
each then rounded once to float32, as eager's kernel rounds:

- a float32 sum or mean over dimensions that leave the innermost one (a column sum, a bias's
  gradient ``grad.sum(0)``): ``summed_line``;
- BatchNorm's training statistics (``native_batch_norm`` with ``training=True``): the mean and
  variance in float64 as eager's kernel computes them, the normalization in float32 from the
  rounded mean, the running statistics updated in float64: ``batch_norm_line``.

Each returns the node (or tuple of nodes) that replaces the line, or None for a line it leaves
as it is. The reads stay fused: the cast to float64 happens inside the reduction's loop.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ...core.proxies import TensorProxy
from ...core.symbols import BoundSymbol

aten = torch.ops.aten

# Sums and means whose float32 accumulation ``_outer_float32_sum`` looks at (each takes the
# tensor, its dimensions and ``keepdim``), and the ATen op each becomes.
_SUMS = {id(f): (f, aten.sum.dim_IntList)
         for f in (torch.sum, torch.Tensor.sum, aten.sum.dim_IntList)}
_SUMS.update({id(f): (f, aten.mean.dim)
              for f in (torch.mean, torch.Tensor.mean, aten.mean.dim)})
# Below this many values a sum's rounding is as eager's whichever way it runs.
_SUMMED_VALUES = 64


def summed_line(graph: fx.Graph, bsym: BoundSymbol, args: tuple) -> fx.Node | None:
    """A column sum or mean accumulated in float64 (``_outer_float32_sum``), else None."""
    dims = _outer_float32_sum(bsym)
    if dims is None:
        return None
    op = _SUMS[id(bsym.symbol.fn)][1]
    keepdim = bool(bsym.args[2] if len(bsym.args) > 2 else bsym.kwargs.get("keepdim", False))
    total = graph.call_function(op, (args[0], dims, keepdim), {"dtype": torch.float64})
    return _float32(graph, total)


def _outer_float32_sum(bsym: BoundSymbol) -> list[int] | None:
    """The dimensions of a float32 sum (or mean) on the CPU over at least ``_SUMMED_VALUES``
    values each that does not sum the tensor's innermost dimension (a column sum:
    ``grad.sum(0)``), else None. Inductor's CPU kernel for such a sum keeps one accumulator per
    column and adds every row to it in order: on 8192 rows its error against float64 was 13-25x
    eager's, whose kernel sums in a cascade; accumulated in float64 it is eager's or less (the
    final rounding to float32), at about the same speed (the sum reads memory at the same
    rate)."""
    fn = getattr(bsym.symbol, "fn", None)
    if id(fn) not in _SUMS or _SUMS[id(fn)][0] is not fn or not bsym.args:
        return None
    x, out = bsym.args[0], bsym.output_proxies()
    if not _float32_cpu(x) or len(out) != 1 or out[0].dtype != torch.float32 \
            or bsym.kwargs.get("dtype"):
        return None
    dims = bsym.args[1] if len(bsym.args) > 1 else bsym.kwargs.get("dim")
    dims = [dims] if type(dims) is int else dims
    if not isinstance(dims, (list, tuple)) or not dims or not all(type(d) is int for d in dims) \
            or set(bsym.kwargs) - {"dim", "keepdim"} or len(bsym.args) > 3:
        return None
    shape, stride = x.shape, x.stride
    if not _static(x) or not shape:
        return None
    dims = sorted({d % len(shape) for d in dims})
    inner = [d for d in range(len(shape)) if stride[d] == 1 and shape[d] > 1]
    summed = 1
    for d in dims:
        summed *= shape[d]
    if not inner or inner[0] in dims or summed < _SUMMED_VALUES:
        return None
    return dims


_BATCH_NORM = aten.native_batch_norm.default


def batch_norm_line(graph: fx.Graph, bsym: BoundSymbol, args: tuple) -> tuple | None:
    """``native_batch_norm(x, w, b, running_mean, running_var, True, momentum, eps)`` on a float32
    CPU tensor of static sizes, as eager's kernel computes it, else None.

    Eager sums each channel in float64, rounds the mean to float32 and computes the variance and
    ``1/sqrt(var + eps)`` in float64; Inductor's decomposition keeps a float32 Welford
    accumulator per channel. A mean off by an ulp moves an element lying between it and the
    exact mean to the other side: the ReLU after it lets the gradient through where float64
    does not (dpn68's last block: one such element gave a BatchNorm bias gradient 25% off, and
    every gradient before it 100x eager's error). With the mean rounded from float64, ``x -
    mean`` has float64's sign for every float32 ``x`` (the subtraction of two close float32
    values is exact). The outputs are the op's: the normalized tensor, the mean and the inverse
    standard deviation (what the backward reads), and the running statistics written in
    place, with the unbiased variance."""
    if getattr(bsym.symbol, "fn", None) is not _BATCH_NORM or len(bsym.args) != 8 or bsym.kwargs:
        return None
    x, weight, bias, running_mean, running_var, training, momentum, eps = bsym.args
    if training is not True or not _float32_cpu(x) or not _static(x) or len(x.shape) < 2 or \
            not all(p is None or _float32_cpu(p) for p in bsym.args[1:5]) or \
            (running_mean is None) != (running_var is None) or \
            not isinstance(momentum, (int, float)) or not isinstance(eps, (int, float)):
        return None
    count = math.prod(x.shape) // x.shape[1]
    if count < 2:  # eager refuses one value per channel in training
        return None
    xn, wn, bn, rmn, rvn = args[:5]
    dims = [0, *range(2, len(x.shape))]
    shape = [1, x.shape[1]] + [1] * (len(x.shape) - 2)
    call = graph.call_function
    wide = call(aten._to_copy.default, (xn,), {"dtype": torch.float64})
    var_mean = call(aten.var_mean.correction, (wide, dims), {"correction": 0, "keepdim": False})
    var = call(operator.getitem, (var_mean, 0))
    mean = call(operator.getitem, (var_mean, 1))
    mean32 = _float32(graph, mean)
    invstd = _float32(graph, call(aten.rsqrt.default, (call(aten.add.Tensor, (var, eps)),)))
    scale = invstd if wn is None else call(aten.mul.Tensor, (invstd, wn))
    out = call(aten.mul.Tensor, (call(aten.sub.Tensor, (xn, call(aten.view.default,
                                                                  (mean32, shape)))),
                                 call(aten.view.default, (scale, shape))))
    if bn is not None:
        out = call(aten.add.Tensor, (out, call(aten.view.default, (bn, shape))))
    if rmn is not None:
        unbiased = call(aten.mul.Tensor, (var, count / (count - 1)))
        for stat, new in ((rmn, mean), (rvn, unbiased)):
            kept = call(aten.mul.Tensor, (call(aten._to_copy.default, (stat,),
                                               {"dtype": torch.float64}), 1 - momentum))
            moved = call(aten.add.Tensor, (kept, call(aten.mul.Tensor, (new, momentum))))
            call(aten.copy_.default, (stat, _float32(graph, moved)))
    return out, mean32, invstd


def _float32(graph: fx.Graph, node: fx.Node) -> fx.Node:
    return graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float32})


def _float32_cpu(x) -> bool:
    return isinstance(x, TensorProxy) and x.dtype == torch.float32 and x.device.type == "cpu"


def _static(x: TensorProxy) -> bool:
    return all(type(n) is int for n in (*x.shape, *x.stride))
