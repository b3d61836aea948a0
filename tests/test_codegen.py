"""The source that runs: ATen overloads are called through their bound C++ entry points.

The printed trace says ``torch.ops.aten.mm.default(a, b)``; the compiled one calls the overload's
``_op`` bound as a global (``OpOverload.__call__`` is only a Python frame around it). These tests
check that the two programs are the same program: same values, and modes see the same ops.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import keraunos
from keraunos.core.symbols import direct_entry


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))


def _backward_trace():
    model = _mlp()
    jmodel = keraunos.jit(model)
    jmodel(torch.randn(3, 4)).sum().backward()
    return keraunos.last_backward_traces(jmodel)[-1]


class _FunctionLog(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


class _DispatchLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _printed_callable(trace):
    """The printed trace, compiled as it reads (``torch.ops.aten.X.Y`` looked up per call)."""
    src, namespace = trace.source()
    exec(compile(src, "<printed>", "exec"), namespace)
    return namespace[trace.name]


def _inputs_for(trace):
    torch.manual_seed(1)
    return [torch.randn(p.shape, dtype=p.dtype) for p in trace.params]


def test_printed_trace_spells_aten_ops_and_the_compiled_one_binds_their_entry_points():
    trace = _backward_trace()
    printed = str(trace)
    assert "torch.ops.aten.mm.default(" in printed
    fn = trace.python_callable()
    assert "torch.ops.aten" not in fn.__keraunos_source__
    bound = {v for v in fn.__globals__.values() if v is torch.ops.aten.mm.default._op}
    assert bound, "the compiled backward does not call aten.mm through its entry point"
    # the same program apart from the callee spelling: same lines, same names
    assert len(printed.splitlines()) == len(fn.__keraunos_source__.splitlines())


def test_compiled_and_printed_trace_give_the_same_values_and_modes_see_the_same_ops():
    trace = _backward_trace()
    inputs = _inputs_for(trace)
    compiled, printed = trace.python_callable(), _printed_callable(trace)
    got, want = compiled(*inputs), printed(*inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    for mode_type in (_FunctionLog, _DispatchLog):
        with mode_type() as seen_compiled:
            compiled(*inputs)
        with mode_type() as seen_printed:
            printed(*inputs)
        assert seen_compiled.funcs == seen_printed.funcs and seen_compiled.funcs
        assert torch.ops.aten.mm.default in seen_compiled.funcs  # the OpOverload, not _op


def test_entry_point_records_autograd_like_the_overload():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(3, 2)
    entry = direct_entry(torch.ops.aten.mm.default)
    out = entry(a, b)
    assert type(out.grad_fn) is type(torch.ops.aten.mm.default(a, b).grad_fn)
    out.sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(2, 2) @ b.T)


def test_only_plain_aten_overloads_get_an_entry_point():
    assert direct_entry(torch.ops.aten.mm.default) is torch.ops.aten.mm.default._op
    assert direct_entry(torch.mm) is None
    assert direct_entry(torch.ops.aten.mm) is None  # the packet picks an overload per call
    assert direct_entry(torch.nn.functional.linear) is None

    class OwnCall(torch._ops.OpOverload):  # as TorchBind ops do: __call__ does more than _op
        def __call__(self, *args, **kwargs):
            raise AssertionError

    fake = object.__new__(OwnCall)
    assert direct_entry(fake) is None
