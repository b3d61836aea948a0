"""jit(..., specialize_data=True): Python values read from tensor data become guarded constants."""
import pytest
import torch
from torch.testing import assert_close

import keraunos


def branchy(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


def test_fallback_error_refuses_control_flow_on_data():
    with pytest.raises(keraunos.CaptureError, match="tensor data"):
        keraunos.jit(branchy, fallback="error")(torch.ones(3))


def test_branch_on_data_matches_eager_both_ways_and_recompiles_on_change():
    jf = keraunos.jit(branchy, specialize_data=True)
    pos, neg = torch.ones(3), -torch.ones(3)
    assert_close(jf(pos), branchy(pos))
    assert_close(jf(neg), branchy(neg))
    assert keraunos.cache_misses(jf) == 2
    assert any("__bool__" in r for r in keraunos.last_cache_miss_reasons(jf))
    assert_close(jf(pos * 3), branchy(pos * 3))  # same branch: a hit
    assert keraunos.cache_hits(jf) == 1


def test_item_used_as_a_number_is_checked_every_call():
    def f(x, n):
        return x * n.max().item()
    jf = keraunos.jit(f, specialize_data=True, dynamic=False)  # a constant (no automatic dynamic)
    x = torch.randn(4)
    assert_close(jf(x, torch.tensor([1, 3])), f(x, torch.tensor([1, 3])))
    assert_close(jf(x, torch.tensor([5, 2])), f(x, torch.tensor([5, 2])))  # new value: recompile
    assert keraunos.cache_misses(jf) == 2
    prologue = str(keraunos.last_prologue_traces(jf)[-1])
    assert ".item() != 5" in prologue


def test_value_from_random_ops_cannot_be_specialized():
    def f(x):
        return x * torch.rand(()).item()
    with pytest.raises(keraunos.CaptureError, match="random or in-place"):
        keraunos.jit(f, specialize_data=True)(torch.ones(2))
