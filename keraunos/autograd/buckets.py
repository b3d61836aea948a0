"""The backward split at DistributedDataParallel's bucket boundaries.

DDP's reducer all-reduces a bucket of gradients as soon as autograd has accumulated every
gradient in it (a hook on each parameter's ``AccumulateGrad``). A backward that is one autograd
node hands autograd every gradient at its very end, so every bucket waits for the whole
backward. ``torch.compile`` splits its graph at the bucket boundaries for that (Dynamo's
DDPOptimizer). Here the split is of the backward trace alone: the forward stays one program.

``plan_segments`` cuts the finished backward trace into consecutive *segments*, the first ending
where the gradients of DDP's first bucket are all computed, and so on, filling buckets as the
reducer does (gradients in the order they become ready, ``first_bucket_bytes_cap`` then
``bucket_bytes_cap`` bytes per bucket, a bucket closing at the gradient that fills it). Each
segment is a trace of its own (its inputs: the saved tensors it reads and the values earlier
segments hand on; its outputs: its gradients and the values later segments read), and runs as
one autograd node (``function.make_segmented_computation``), so each bucket's all-reduce starts
while the later segments run. The cut comes before fusion, which forms regions within each
segment (a region across a boundary would hand its gradients over at its end only).
``display_trace`` is the whole backward with a comment at each boundary, for
``last_backward_traces``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from ..core import glue
from ..core.proxies import Proxy, TensorProxy
from ..core.trace import Trace


@dataclass(frozen=True)
class BucketCaps:
    """How many bytes DDP's reducer puts in its first bucket and in each one after it."""

    first: int
    rest: int

    def limits(self):
        yield self.first
        while True:
            yield self.rest


def active_ddp_bucket_caps() -> BucketCaps | None:
    """The bucket sizes of the DistributedDataParallel module whose forward is running (DDP
    marks it for the duration of its forward, for Dynamo's DDPOptimizer), or None outside one."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or getattr(ddp, "_use_python_reducer", False):
        return None
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        if config.per_bucket_bytes_caps:  # bucket_cap_mb_list: buckets of their own sizes
            return None
        return BucketCaps(config.first_bucket_bytes_cap, config.bucket_bytes_cap)
    rest = ddp.bucket_bytes_cap
    default = getattr(ddp, "bucket_bytes_cap_default", False)
    return BucketCaps(torch.distributed._DEFAULT_FIRST_BUCKET_BYTES if default else rest, rest)


@dataclass
class Segment:
    """One autograd node's share of the backward: ``trace(*saved, *carried_in)`` returns
    ``(*gradients, *carried_out)``."""

    trace: Trace
    saved: list[int]          # indices into the forward's saved tensors, in the trace's order
    carried_in: list[str]     # names the previous segment hands on (the first: sizes and grads)
    carried_out: list[str]    # names later segments read
    gradients: list[int]      # the computation inputs whose gradients the trace returns
    inputs: list[int]         # the node's inputs: those, and for the last node every input
                              # that gets no gradient from any line (None)


@dataclass
class SegmentPlan:
    segments: list[Segment]   # in the order the backward runs them


def plan_segments(backward: Trace, forward: Trace, n_saved: int,
                  caps: BucketCaps) -> SegmentPlan | None:
    """The backward cut at DDP's bucket boundaries, or None when it is one bucket (nothing to
    overlap) or is not cut: sizes not known, or an output that is one of the inputs itself
    (autograd hands an input back as an output only from a node that takes it). A view of an
    input is an output like any other (checked by hand, not in the tests: a parameter's ``.t()``
    among the outputs gives eager DDP's gradients)."""
    *body, ret = backward.bound_symbols
    inputs = forward.params
    sizes = [_bytes(p) for p in inputs]
    if any(isinstance(p, TensorProxy) and s is None for p, s in zip(inputs, sizes)):
        return None
    if _outputs_alias_inputs(forward):
        return None
    defined_at = {}
    for i, b in enumerate(body):
        for p in b.output_proxies():
            defined_at[p.name] = i
    grads = ret.args[0]
    ready = sorted((defined_at.get(g.name, -1), i) for i, g in enumerate(grads)
                   if isinstance(g, Proxy) and sizes[i])
    if not ready:
        return None
    cuts, filled, limits = [], 0, caps.limits()
    limit = next(limits)
    for at, i in ready:
        filled += sizes[i]
        if filled >= limit:
            cuts.append(at)
            filled, limit = 0, next(limits)
    last_grad = ready[-1][0]
    cuts = sorted({_after_deletes(body, c) for c in cuts if c < last_grad})
    if not cuts:
        return None
    bounds = list(zip([-1] + cuts, cuts + [len(body) - 1]))
    return _segments(backward, body, grads, bounds, defined_at, n_saved)


def _bytes(p) -> int | None:
    """An input's size in bytes (0 for a non-tensor), None when its shape is symbolic."""
    if not isinstance(p, TensorProxy):
        return 0
    if not all(type(d) is int for d in p.shape):
        return None
    return prod(p.shape) * p.dtype.itemsize


def _outputs_alias_inputs(forward: Trace) -> bool:
    """An output that is an input, or an ATen-level view of one (kept on one node, cautiously:
    torch-level views are not followed, and need not be)."""
    from .split import _view_roots
    outputs = forward.bound_symbols[-1].args[0]
    roots = _view_roots(forward.bound_symbols[:-1])
    params = {p.name for p in forward.params if isinstance(p, Proxy)}
    return any(isinstance(o, Proxy) and roots.get(o.name, o.name) in params for o in outputs)


def _after_deletes(body: list, at: int) -> int:
    """A boundary after line ``at`` moves past the ``del`` lines that follow it: they free what
    that segment was the last to read."""
    while at + 1 < len(body) and body[at + 1].symbol is glue.DELETE:
        at += 1
    return at


def _segments(backward: Trace, body: list, grads: list, bounds: list, defined_at: dict,
              n_saved: int) -> SegmentPlan:
    params, returns = backward.params, backward.bound_symbols[-1]
    saved_names = {p.name: i for i, p in enumerate(params[:n_saved])}
    entry = [p.name for p in params[n_saved:]]  # data-dependent sizes, then output gradients
    proxies = {p.name: p for p in params}
    for b in body:
        proxies.update((p.name, p) for p in b.output_proxies())
    reads = []
    for start, end in bounds:
        names = set()
        for b in body[start + 1:end + 1]:
            names.update(p.name for p in b.input_proxies())
        reads.append(names)
    grad_segment = {}
    for i, g in enumerate(grads):
        if isinstance(g, Proxy):
            at = defined_at.get(g.name, -1)
            grad_segment[i] = next(k for k, (_, end) in enumerate(bounds) if at <= end)
    segments, carried = [], entry
    for k, (start, end) in enumerate(bounds):
        lines = body[start + 1:end + 1]
        mine = sorted(i for i, s in grad_segment.items() if s == k)
        returned = {grads[i].name for i in mine}
        later = set().union(*reads[k + 1:]) if k + 1 < len(bounds) else set()
        available = carried + [p.name for b in lines for p in b.output_proxies()]
        carried_out = [n for n in dict.fromkeys(available) if n in later]
        saved = sorted({saved_names[n] for n in reads[k] | returned if n in saved_names})
        segment_params = [params[i] for i in saved] + [proxies[n] for n in carried]
        out = [grads[i] for i in mine] + [proxies[n] for n in carried_out]
        trace = Trace(f"backward_segment{k}", segment_params,
                      lines + [glue.RETURN.bind(out, executor=returns.executor)],
                      backward.header + [f"Segment {k} of the backward split at DDP's bucket "
                                         f"boundaries"], dict(backward.namespace))
        segments.append(Segment(trace, saved, list(carried), carried_out, mine, mine))
        carried = carried_out
    # Gradients that come from no line of the backward (None, or an input never reached) go
    # back from the last node, with the inputs that get none.
    rest = [i for i in range(len(grads)) if i not in grad_segment]
    segments[-1].inputs = sorted(segments[-1].gradients + rest)
    return SegmentPlan(segments)


def display_trace(plan: SegmentPlan, backward: Trace) -> Trace:
    """The backward as its segments run it, one after the other, each boundary marked (without
    the segments' own ``del`` lines: a saved tensor each segment reads is deleted in each)."""
    lines = []
    for k, segment in enumerate(plan.segments):
        *body, ret = segment.trace.bound_symbols
        lines += [b for b in body if b.symbol is not glue.DELETE]
        if k + 1 < len(plan.segments):
            names = ", ".join(p.name for p in ret.args[0][:len(segment.gradients)]) or "none"
            lines.append(glue.PYTHON.bind(label="bucket boundary", lines=_comment(
                f"DDP bucket boundary: autograd node {k} ends; its gradients ({names}) go to "
                f"DDP's reducer, whose all-reduce runs while the rest of the backward does"),
                outputs=None))
    return backward.derive(lines + [backward.bound_symbols[-1]],
                           f"Backward Split at DDP's Bucket Boundaries "
                           f"({len(plan.segments)} autograd nodes)")


def _comment(text: str):
    return lambda w: [f"# {text}"]
