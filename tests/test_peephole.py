"""The backward peephole (keraunos/passes/peephole.py): lines that hand on their input's data
unchanged (``t(t(w))``, ``detach(detach(x))``, ``x ** 1.0``) are read past on the backend route.
Each test compares with eager PyTorch, and with the backward as it was before the pass, run on
the same inputs: the values and strides must be identical, not merely close."""
import copy

import pytest
import torch

import keraunos.dynamo as kd
from helpers import assert_grads_match, check_grads
from keraunos.core.proxies import TensorProxy
from keraunos.core.symbols import BoundSymbol, TorchSymbol
from keraunos.core.tags import MUTATION
from keraunos.core.trace import Trace
from keraunos.passes.peephole import read_past_noop_chains

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _backward_traces(compiled) -> list:
    (subgraph,) = kd.last_traces(compiled)
    return subgraph.backward


def _before_and_after(traces):
    """The backward just before the peephole and just after it."""
    at = next(i for i, t in enumerate(traces) if t.header[-1].startswith("Constructed by Peephole"))
    return traces[at - 1], traces[at]


def _ops(trace, op) -> list:
    return [b for b in trace.bound_symbols if getattr(b.symbol, "fn", None) is op]


def _inputs_for(trace, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for p in trace.params:
        t = torch.empty_strided(p.shape, p.stride, dtype=p.dtype)
        inputs.append(t.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype)))
    return inputs


def _assert_runs_identically(before, after):
    """Both traces, run on the same inputs, return the same values with the same strides."""
    inputs = _inputs_for(before)
    want = before.python_callable()(*[t.clone() for t in inputs])
    got = after.python_callable()(*[t.clone() for t in inputs])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert torch.equal(g, w) and g.stride() == w.stride()


def test_transpose_pairs_of_linear_backward_are_read_past():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="keraunos")
    compiled(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_match(model, ref)
    before, after = _before_and_after(_backward_traces(compiled))
    made_by_t = {b.outputs.name for b in _ops(before, aten.t.default)}
    assert any(b.args[0].name in made_by_t for b in _ops(before, aten.t.default))  # t(t(...))
    made_by_t = {b.outputs.name for b in _ops(after, aten.t.default)}
    assert not any(b.args[0].name in made_by_t for b in _ops(after, aten.t.default))
    assert len(_ops(after, aten.t.default)) < len(_ops(before, aten.t.default))
    _assert_runs_identically(before, after)


def test_power_of_one_in_the_derivative_of_a_square_is_read_past():
    def f(x, w):
        return (x * w) ** 2

    x, w = torch.randn(4, 5), torch.randn(5, requires_grad=True)
    compiled = check_grads(f, x, w, jit=torch.compile, backend="keraunos")
    before, after = _before_and_after(_backward_traces(compiled))
    assert any(b.args[1] == 1 for b in _ops(before, aten.pow.Tensor_Scalar))
    assert not any(b.args[1] == 1 for b in _ops(after, aten.pow.Tensor_Scalar))
    _assert_runs_identically(before, after)


def _assert_accumulate_apart(leaves, step):
    """Gradients that share no memory: a second backward doubles each of them. (Eager's own
    gradients share memory here, both views of one buffer that AccumulateGrad keeps, so eager's
    second backward adds into both at once; only the first is compared with eager.)"""
    firsts = [t.grad.clone() for t in leaves]
    storages = {t.grad.untyped_storage().data_ptr() for t in leaves}
    assert len(storages) == len(leaves)
    step()
    for t, first in zip(leaves, firsts):
        torch.testing.assert_close(t.grad, 2 * first)


def test_two_gradients_from_one_tensor_stay_two_objects():
    # grad a and grad b are both t(t(grad0 * c)), one tensor returned twice once read past:
    # autograd must still keep two gradients, so that the next backward adds to each once.
    def f(a, b, c):
        return (a.t().t() + b.t().t()) * c

    leaves = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    c = torch.randn(3, 4)
    compiled = check_grads(f, *leaves, c, jit=torch.compile, backend="keraunos")
    _assert_accumulate_apart(leaves, lambda: compiled(*leaves, c).sum().backward())
    before, after = _before_and_after(_backward_traces(compiled))
    _assert_runs_identically(before, after)


def test_an_incoming_gradient_is_not_returned_as_a_parameters_gradient():
    # grad x is grad0 itself, grad w is t(t(grad0)): returning grad0 for w as well would make
    # x.grad and w.grad one object.
    def f(x, w):
        return x * 2 + w.t().t()

    x, w = (torch.randn(3, 4, requires_grad=True) for _ in range(2))
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    compiled = torch.compile(f, backend="keraunos")
    compiled(x, w).backward(torch.ones(3, 4))
    f(x_ref, w_ref).backward(torch.ones(3, 4))
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    _assert_accumulate_apart([x, w], lambda: compiled(x, w).backward(torch.ones(3, 4)))
    before, after = _before_and_after(_backward_traces(compiled))
    params = {p.name for p in after.params}
    assert not any(p.name in params for p in after.bound_symbols[-1].input_proxies())
    _assert_runs_identically(before, after)


def _line(op, args, out, tags=()):
    return BoundSymbol(TorchSymbol(op, f"torch.ops.{op}", "function"), tuple(args), {}, out,
                       tags=set(tags))


def _proxy(name, tensor):
    return TensorProxy(name, tensor)


def test_a_copy_is_not_read_past_when_the_trace_writes_in_place():
    # p = x ** 1 keeps x's old values; after x.add_(1), reading x instead of p would see new ones.
    x, p, x2, z = (_proxy(name, torch.randn(3)) for name in ("x", "p", "x2", "z"))
    lines = [_line(aten.pow.Tensor_Scalar, (x, 1.0), p),
             _line(aten.add_.Tensor, (x, 1), x2, tags=(MUTATION,)),
             _line(aten.mul.Tensor, (p, 2), z)]
    trace = Trace("backward", [x], lines)
    kept = read_past_noop_chains(trace).bound_symbols
    assert kept[-1].args[0] is p and kept[0].outputs is p
    without_write = Trace("backward", [x], [lines[0], lines[2]])
    (mul,) = read_past_noop_chains(without_write).bound_symbols
    assert mul.args[0] is x


def test_a_view_read_by_an_op_that_may_return_its_input_is_kept():
    # contiguous(y) returns y itself when y is contiguous: reading x there would make the
    # result x, a different object.
    x = _proxy("x", torch.randn(3, 4))
    a, y, z = (_proxy(n, torch.randn(s)) for n, s in (("a", (4, 3)), ("y", (3, 4)), ("z", (3, 4))))
    lines = [_line(aten.t.default, (x,), a), _line(aten.t.default, (a,), y),
             _line(aten.contiguous.default, (y,), z)]
    out = read_past_noop_chains(Trace("backward", [x], lines)).bound_symbols
    assert out[-1].args[0] is y and len(out) == 3
