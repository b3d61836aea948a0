"""The peak memory of a step, as the profiler's allocation records show it.

``peak_bytes(step)`` profiles two calls of ``step`` with ``profile_memory=True`` and measures the
second: the most bytes its tensors held at once beyond what was held when it started. The first
call is profiled too, so that the frees of what it allocated (the gradients a ``zero_grad``
drops) are seen; each allocation and free is counted when it happened (not, as
``prof.events()`` counts them, at the start of the op that encloses them)."""
from __future__ import annotations

from typing import Callable

import torch

from ..torch_internals.autograd import allocations, marked

_MARK = "keraunos: the measured step"


def peak_bytes(step: Callable[[], object]) -> int:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
        with torch.profiler.record_function(_MARK):
            pass
        step()
    start = marked(prof, _MARK)
    live = peak = 0
    for at, nbytes in allocations(prof):
        if at >= start:
            live += nbytes
            peak = max(peak, live)
    return peak
