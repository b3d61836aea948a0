"""A call that hands back its own tensor argument unchanged is no line of the computation.

``x.float()`` of a float tensor, ``.contiguous()`` of a contiguous one, ``.to(x.device)``: eager
returns the very argument, so the compiled program has nothing to run for them (Hugging Face's
decode step made 24 such calls, each a Python call and a dispatch). What made the call return its
argument (dtype, device, layout, a size) is checked by the prologue. Compared with eager PyTorch:
values, strides, identity of what is returned, gradients.
"""
import torch
from torch.testing import assert_close

from helpers import check_grads
import keraunos


def casts(x, w):
    y = x.float().contiguous().to(x.device)
    return (y @ w).to(torch.float32), y


def test_calls_returning_their_argument_leave_no_line():
    jf = keraunos.jit(casts)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    got, got_y = jf(x, w)
    want, want_y = casts(x, w)
    assert_close(got, want)
    assert got_y is x and want_y is x  # the very argument, as in eager
    code = program_text(keraunos.last_traces(jf)[-1])
    assert ".float()" not in code and ".contiguous()" not in code and ".to(" not in code
    assert "matmul" in code


def program_text(trace) -> str:
    """The trace's statements, without its comments (which quote the user's source lines)."""
    lines = [line.split("  # ")[0] for line in str(trace).splitlines()]
    return "\n".join(line for line in lines if not line.strip().startswith("#"))


def test_a_call_that_copies_stays_a_line():
    def transposed(x):
        return x.t().contiguous().double()
    jf = keraunos.jit(transposed)
    x = torch.randn(3, 5)
    got = jf(x)
    assert_close(got, transposed(x))
    assert got.stride() == transposed(x).stride() and got.dtype is torch.float64
    code = program_text(keraunos.last_traces(jf)[-1])
    assert ".contiguous()" in code and ".double()" in code


def test_the_same_program_on_another_dtype_compiles_the_cast():
    jf = keraunos.jit(casts)
    w = torch.randn(8, 3)
    for x in (torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64)):
        got, got_y = jf(x, w)
        want, want_y = casts(x, w)
        assert_close(got, want)
        assert got_y.dtype is want_y.dtype and (got_y is x) == (want_y is x)
    assert keraunos.cache_misses(jf) == 2
    assert ".float()" in program_text(keraunos.last_traces(jf)[-1])  # a float64 x is cast


def test_contiguity_decided_on_a_symbolic_size_is_guarded():
    def prefix(x, n):
        y = x[:, :n].contiguous()  # returns the slice itself only when n is the full width
        return y.view(-1) * 2, y
    jf = keraunos.jit(prefix, cache="symbolic values")
    for shape, n in (((4, 8), 8), ((4, 8), 5), ((3, 6), 6), ((5, 7), 3)):
        x = torch.randn(*shape)
        got, got_y = jf(x, n)
        want, want_y = prefix(x, n)
        assert_close(got, want)
        assert got_y.stride() == want_y.stride()
    assert keraunos.cache_misses(jf) == 2  # n equal to the width, and n below it


def test_gradients_flow_through_calls_returning_their_argument():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    check_grads(casts, x, w, loss=lambda out: out[0].sum())
