"""Cache entries are used only when valid, and released with their entry (issue 8, items 10-16).

Every test compares the jitted program with eager PyTorch on twins of the same state."""
import copy

import torch
from torch import nn
from torch.testing import assert_close

import keraunos


def counts(jitted):
    return keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)


class AddsToBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4))
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        self.buf.add_(1)
        return x * 2


# ------------------------------------------- 10: an argument that is a view of a written buffer
def test_view_of_buffer_written_in_place_gives_eager_result():
    m = AddsToBuffer()
    e = copy.deepcopy(m)
    jm = keraunos.jit(m)
    for _ in range(2):
        out, expected = jm(m.buf[:2]), e(e.buf[:2])
        assert_close(out, expected)
        assert_close(m.buf, e.buf)
    assert counts(jm) == (1, 1)
    out, expected = jm(torch.ones(4)), e(torch.ones(4))  # no longer aliasing: another entry
    assert_close(out, expected)
    assert_close(m.buf, e.buf)
