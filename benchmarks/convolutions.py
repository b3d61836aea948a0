"""Each convolution of a torchvision model timed alone at its shapes, in eager's layout (NCHW)
and on channels-last copies, forward and backward: the measurements behind keraunos's rule for
which convolutions of a fused region run channels-last (``executors/fusion/channels_last.py``).

Run: python benchmarks/convolutions.py [--model efficientnet_b0] [--batch 2] [--size 64]
[--rounds 30]

One intra-op thread. The convolutions are found by running the model once with forward hooks
(random weights, a batch of ``--batch`` images of ``--size`` pixels), and each is timed with
tensors of its shapes, the variants in turns (one call of each per round, medians of
``--rounds``), so that a busy machine slows them alike:

- ``nchw``: ``F.conv2d`` / ``aten.convolution_backward`` on contiguous tensors, as eager runs them;
- ``cl``: the same on channels-last tensors made beforehand (the kernels alone);
- ``cl+copies``: copies of the NCHW tensors into channels-last, the kernel, and the input's
  gradient (or the output) copied back: what a region pays at most when Inductor cannot fold a
  copy into the kernel that makes the value.

Prints, per kind of convolution (grouped; 1x1 by image size; other dense), the sums of each
variant and their ratios to ``nchw``; then the sums under keraunos's rule against all-NCHW.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from keraunos.testing.vision import import_torchvision
from turns import medians_in_turns

CL = torch.channels_last
BACKWARD = torch.ops.aten.convolution_backward.default


def convolutions(model: torch.nn.Module, x: torch.Tensor) -> list[tuple]:
    """(module, input shape, output shape) of every ``nn.Conv2d`` the model runs on ``x``."""
    found = []
    hooks = [m.register_forward_hook(lambda m, i, o: found.append((m, i[0].shape, o.shape)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return found


def variants(conv: torch.nn.Conv2d, in_shape, out_shape) -> dict:
    """The calls to time for one convolution: name -> a function of no arguments."""
    x, g = torch.randn(in_shape), torch.randn(out_shape)
    w = torch.randn(conv.weight.shape)
    xc, gc = x.contiguous(memory_format=CL), g.contiguous(memory_format=CL)
    options = (conv.stride, conv.padding, conv.dilation, conv.groups)

    def forward(x):
        return F.conv2d(x, w, None, *options)

    def backward(g, x):
        return BACKWARD(g, x, w, None, conv.stride, conv.padding, conv.dilation, False, [0, 0],
                        conv.groups, [True, True, False])

    def forward_copied():
        return forward(x.contiguous(memory_format=CL)).contiguous()

    def backward_copied():
        grad_input, grad_weight, _ = backward(g.contiguous(memory_format=CL),
                                              x.contiguous(memory_format=CL))
        return grad_input.contiguous(), grad_weight

    return {"forward nchw": lambda: forward(x), "forward cl": lambda: forward(xc),
            "forward cl+copies": forward_copied,
            "backward nchw": lambda: backward(g, x), "backward cl": lambda: backward(gc, xc),
            "backward cl+copies": backward_copied}


def kind(conv: torch.nn.Conv2d, in_shape) -> str:
    if conv.groups > 1:
        return "grouped"
    if conv.kernel_size == (1, 1) and conv.stride == (1, 1):
        return f"1x1, {in_shape[2]}x{in_shape[3]} pixels"
    return "other dense"


def rule(conv: torch.nn.Conv2d, in_shape, out_shape) -> tuple[bool, bool]:
    """Whether keraunos's rule runs the forward and the backward channels-last (one thread,
    float32, images contiguous): the constants of ``channels_last``."""
    from keraunos.executors.fusion.channels_last import BACKWARD_PIXELS, FORWARD_PIXELS
    if conv.groups > 1:
        return True, False
    small = (conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.padding == (0, 0)
             and in_shape[0] < 16)
    pixels = in_shape[2] * in_shape[3]
    return small and 1 < pixels <= FORWARD_PIXELS, small and 1 < pixels <= BACKWARD_PIXELS


def timed(calls: dict, rounds: int) -> dict:
    for call in calls.values():  # the first call of each: allocations, oneDNN's primitives
        call()
    return medians_in_turns(calls, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="efficientnet_b0")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(import_torchvision().models, args.model)().eval()
    found = convolutions(model, torch.randn(args.batch, 3, args.size, args.size))
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    by_rule = {"nchw": 0.0, "rule": 0.0}
    for conv, in_shape, out_shape in found:
        medians = timed(variants(conv, in_shape, out_shape), args.rounds)
        group = kind(conv, in_shape)
        counts[group] = counts.get(group, 0) + 1
        for name, t in medians.items():
            sums.setdefault(group, {}).setdefault(name, 0.0)
            sums[group][name] += t
        forward_cl, backward_cl = rule(conv, in_shape, out_shape)
        by_rule["nchw"] += medians["forward nchw"] + medians["backward nchw"]
        by_rule["rule"] += medians["forward cl+copies" if forward_cl else "forward nchw"]
        by_rule["rule"] += medians["backward cl+copies" if backward_cl else "backward nchw"]
    print(f"torch {torch.__version__}, 1 thread, {args.model}, ({args.batch}, 3, {args.size}, "
          f"{args.size}), medians of {args.rounds} rounds in turns; sums in ms, ratios to nchw")
    def order(group: str):  # grouped, then 1x1 by image size, then the rest
        pixels = int(group.split(", ")[1].split("x")[0]) if group.startswith("1x1") else 0
        return (group == "other dense", group.startswith("1x1"), pixels)
    for group in sorted(sums, key=order):
        cells = sums[group]
        line = []
        for step in ("forward", "backward"):
            base = cells[f"{step} nchw"]
            line.append(f"{step}: nchw {base * 1e3:6.2f}" + "".join(
                f", {v} {cells[f'{step} {v}'] * 1e3:6.2f} ({cells[f'{step} {v}'] / base:.2f}x)"
                for v in ("cl", "cl+copies")))
        print(f"  {group:<22} ({counts[group]:>2})  " + "   ".join(line))
    print(f"  forward and backward, every convolution: nchw {by_rule['nchw'] * 1e3:.2f} ms, "
          f"keraunos's rule {by_rule['rule'] * 1e3:.2f} ms "
          f"({by_rule['rule'] / by_rule['nchw']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
