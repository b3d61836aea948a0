"""specialize_data=True: an int read from tensor data whose value changes becomes a size symbol.

The prologue computes the value from the inputs on every call (``s0 = t0.item()``) and checks the
guards the program's decisions on it left (``s0 <= 7``), as it does for sizes; slices by it are
symbolic. So a position read with ``input_pos.max().item()`` costs one more compilation when it
first changes, not one per position. Every test compares with eager PyTorch.
"""
import re

import pytest
import torch
from torch.testing import assert_close

import keraunos


def prefix_sum(x, n):
    k = n.max().item()
    return x[:k + 1] * 2


def test_an_int_read_from_data_that_changes_becomes_a_symbol():
    jf = keraunos.jit(prefix_sum, specialize_data=True)
    x = torch.randn(16)
    for k in (3, 5, 7, 9, 12):
        n = torch.tensor([1, k])
        assert_close(jf(x, n), prefix_sum(x, n))
    # The first value is a constant; the second recompiles with it symbolic; later ones hit.
    assert keraunos.cache_misses(jf) == 2
    assert keraunos.cache_hits(jf) == 3
    assert any("changed 3 → 5; recompiled with it symbolic" in r
               for r in keraunos.last_cache_miss_reasons(jf))
    prologue = str(keraunos.last_prologue_traces(jf)[-1])
    assert "s0 = t0.item()" in prologue  # recomputed on every call, then its guards
    assert "x[:1 + s0]" in str(keraunos.last_traces(jf)[-1])


def test_symbolic_values_mode_makes_it_a_symbol_from_the_first_call():
    jf = keraunos.jit(prefix_sum, specialize_data=True, cache="symbolic values")
    x = torch.randn(16)
    for k in (3, 5, 7, 9):
        n = torch.tensor([k, 0])
        assert_close(jf(x, n), prefix_sum(x, n))
    assert keraunos.cache_misses(jf) == 1


def windowed(x, n):
    k = n.max().item()
    if k < 4:  # a decision on the symbol: a guard of the entry, not a constant
        return x[:k + 1].sum(0)
    return x[k - 3:k + 1].sum(0) * 2


def test_decisions_on_a_data_symbol_are_guards_each_side_one_entry():
    jf = keraunos.jit(windowed, specialize_data=True, cache="symbolic values")
    x = torch.randn(12, 3)
    for k in (2, 3, 4, 6, 9, 2, 11, 3):
        n = torch.tensor([k])
        assert_close(jf(x, n), windowed(x, n))
    assert keraunos.cache_misses(jf) == 2  # k < 4 and k >= 4
    assert keraunos.cache_hits(jf) == 6
    assert any(re.search(r"s\d+ <= 3 \(s\d+ is the value of \.item\(\)", r)
               for r in keraunos.last_cache_miss_reasons(jf))


def two_reads(x, n):
    a = n.max().item()
    b = n.max().item()  # what each layer of a model does with the position
    return x[:a + 1] + x[1:b + 2]


def test_the_same_value_read_twice_is_one_symbol_computed_once():
    jf = keraunos.jit(two_reads, specialize_data=True, cache="symbolic values")
    x = torch.randn(10)
    for k in (2, 5, 7):
        n = torch.tensor([k])
        assert_close(jf(x, n), two_reads(x, n))
    assert keraunos.cache_misses(jf) == 1
    prologue = str(keraunos.last_prologue_traces(jf)[-1])
    assert prologue.count(".item()  # the value") == 1 and prologue.count(".max()  # t") == 1


def sliced_by_size(x, n, m):
    k = n[:m].max().item()  # computed from a slice whose size is a symbol
    return x[:k + 1] * m


def test_a_value_computed_with_symbolic_sizes_is_recomputed_with_the_calls_sizes():
    jf = keraunos.jit(sliced_by_size, specialize_data=True, cache="symbolic values")
    x, n = torch.randn(20), torch.tensor([4, 9, 2, 15, 7, 3])
    for m in (2, 3, 4, 5):
        assert_close(jf(x, n, m), sliced_by_size(x, n, m))
    assert keraunos.cache_misses(jf) == 1


def written_through_a_view(x, n):
    n.view(-1).add_(1)  # writes n's memory through another tensor
    return x * n.max().item()


def test_a_value_whose_memory_the_program_wrote_before_is_refused():
    # The prologue would compute it from n as passed, before the write: a wrong value (it was
    # x * 3 where eager gives x * 4 before this was refused).
    with pytest.raises(keraunos.CaptureError, match="random or in-place"):
        keraunos.jit(written_through_a_view, specialize_data=True)(
            torch.randn(3), torch.tensor([1, 3]))


def scaled(x, n):
    return x * n.float().mean().item()


def test_a_float_read_from_data_stays_a_checked_constant():
    jf = keraunos.jit(scaled, specialize_data=True, cache="symbolic values")
    x = torch.randn(4)
    for values in ([1, 3], [2, 6], [1, 3]):
        n = torch.tensor(values)
        assert_close(jf(x, n), scaled(x, n))
    assert keraunos.cache_misses(jf) == 2 and keraunos.cache_hits(jf) == 1
