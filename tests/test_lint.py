"""The trace checker: malformed traces are caught, and every trace the pipeline makes passes
(the suite runs with KERAUNOS_LINT=1, so every pass's output and every compiled trace is
checked; these tests check the checker)."""
import pytest
import torch

import keraunos
from keraunos.core.lint import TraceLintError, problems
from keraunos.core.proxies import TensorProxy
from keraunos.core.glue import Glue
from keraunos.core.symbols import BoundSymbol
from keraunos.core.trace import Trace


def _glue(name, *lines):
    return Glue(name, lambda bsym, w: list(lines))


def _trace(*symbols, params=("*args", "**kwargs")):
    return Trace("prologue", list(params), [BoundSymbol(s) for s in symbols])


def test_a_prologue_reading_a_local_before_it_is_bound_is_caught():
    t = _trace(_glue("check", "if x.shape != (2,): return 0"), _glue("unpack", "x = args[0]"),
               _glue("return", "return (x,), ()"))
    with pytest.raises(TraceLintError, match="reads x before anything binds it"):
        t.lint()


def test_a_name_bound_twice_is_caught_but_a_conditional_update_is_not():
    twice = _trace(_glue("unpack", "x = args[0]"), _glue("unpack", "x = args[1]"),
                   _glue("return", "return (x,), ()"))
    assert any("x is bound a second time" in p for p in problems(twice))
    update = _trace(_glue("unpack", "x = args[0]"),
                    _glue("refresh", "if x is None:", "  x = args[1]"),
                    _glue("return", "return (x,), ()"))
    assert problems(update) == []


def test_a_read_after_del_is_caught():
    t = _trace(_glue("unpack", "x = args[0]"), _glue("delete", "del x"),
               _glue("return", "return (x,), ()"))
    assert any("after its del" in p for p in problems(t))


def test_a_proxy_read_before_the_line_that_makes_it_is_caught():
    x = _proxy("x")
    y = _proxy("y")
    ret = Glue("return", lambda bsym, w: [f"return {bsym.args[0].name}"])
    t = Trace("computation", [x], [BoundSymbol(ret, args=(y,))])
    assert any("reads y, which nothing before it binds" in p for p in problems(t))


def _proxy(name):
    return TensorProxy(name, torch.empty(2))


def test_every_trace_of_a_training_step_passes():
    from keraunos.examples.gpt import GPT, GPTConfig
    model = GPT(GPTConfig())
    idx = torch.randint(0, GPTConfig().vocab_size, (2, 8))
    jm = keraunos.jit(model)
    out = jm(idx)
    torch.testing.assert_close(out, model(idx))
    out.sum().backward()
    traces = (keraunos.last_prologue_traces(jm) + keraunos.last_traces(jm)
              + keraunos.last_epilogue_traces(jm) + keraunos.last_backward_traces(jm))
    assert len(traces) > 8
    for t in traces:
        assert problems(t) == [], t.header[-1]
