"""The seams a second fusion executor and a new effect plug into (docs/architecture.md).

A fusion executor is one class (``executors.FusionExecutor``): the toy below, which "fuses" runs
of pointwise ops into one Python function, plugs in with this file alone. A new effect is a tag
and one entry of ``core.effects.EFFECTS``: DCE, CSE and fusion then respect it.
"""
from dataclasses import dataclass, field

import pytest
import torch

import keraunos
from keraunos.core import effects, glue
from keraunos.core.symbols import BoundSymbol, TorchSymbol
from keraunos.core.tags import Tag
from keraunos.core.trace import Trace
from keraunos.executors import FusionExecutor, give_back

_POINTWISE = {"add", "mul", "sub", "relu", "sin", "cos", "tanh", "exp"}


@dataclass
class ToyRegion:
    name: str
    lines: list
    trace: Trace
    layer: str | None = None
    written: list = field(default_factory=list)

    def describe_kernel(self) -> str:
        return "a Python function of its lines"

    def ready(self) -> None:
        pass

    @property
    def source(self) -> str:
        return str(self.trace)


class ToyFusion(FusionExecutor):
    """Each run of two or more pointwise torch calls becomes one call of a Python function."""

    name = "toy_fusion"

    def claims(self, bsym):
        return (isinstance(bsym.symbol, TorchSymbol) and effects.may_fuse(bsym)
                and bsym.symbol.name.rsplit(".", 1)[-1] in _POINTWISE)

    def fuse(self, trace, executors, *, observable, always_checked=frozenset(),
             records_autograd=False, forward=None, counter=None, min_shared_layers=2):
        counter = counter if counter is not None else [0]
        lines, result, regions = list(trace.bound_symbols), [], []
        i = 0
        while i < len(lines):
            j = i
            while j < len(lines) and lines[j].executor == self.name:
                j += 1
            if j - i < 2:
                result += [give_back(b, executors) if b.executor == self.name else b
                           for b in lines[i:max(j, i + 1)]]
                i = max(j, i + 1)
                continue
            run, later = lines[i:j], lines[j:]
            made = {p.name for b in run for p in b.output_proxies()}
            inputs = list({p.name: p for b in run for p in b.input_proxies()
                           if p.name not in made}.values())
            read_later = {p.name for b in later for p in b.input_proxies()}
            outputs = [p for b in run for p in b.output_proxies() if p.name in read_later]
            name = f"toy_region{counter[0]}"
            counter[0] += 1
            region_trace = Trace(name, inputs, run + [glue.RETURN_REGION.bind(*outputs)])
            region = ToyRegion(name, run, region_trace)
            regions.append(region)
            result.append(BoundSymbol(glue.FusionCall(region, region_trace.python_callable()),
                                      tuple(inputs), outputs=tuple(outputs), subsymbols=run,
                                      executor=self.name))
            i = j
        return trace.derive(result, f"Toy Fusion: {len(regions)} regions"), regions


@pytest.fixture
def toy():
    executor = keraunos.executors.register(ToyFusion())
    yield executor


def test_a_second_fusion_executor_plugs_in_forward_and_backward(toy):
    def f(x, w):
        return ((x @ w).sin() * 2 + 1).relu().sum()

    x, w = torch.randn(4, 8), torch.randn(8, 3, requires_grad=True)
    jitted = keraunos.jit(f, executors=["toy_fusion", "torch"], fuse="wait")
    got = jitted(x, w)
    want = f(x, w.detach().requires_grad_())
    torch.testing.assert_close(got, want)

    w_eager = w.detach().clone().requires_grad_()
    f(x, w_eager).backward()
    got.backward()
    torch.testing.assert_close(w.grad, w_eager.grad)

    text = str(keraunos.last_traces(jitted)[-1])
    assert "toy_region0(" in text and "a Python function of its lines" in text
    assert "Constructed by Toy Fusion: 1 regions (took " in text  # the runner timed it
    regions = keraunos.last_fusions(jitted)
    assert [type(r) for r in regions] == [ToyRegion]
    assert [b.symbol.name.rsplit(".", 1)[-1] for b in regions[0].lines][:2] == ["sin", "mul"]
    assert keraunos.compile_stats(jitted).tier == "fused"


# A new effect: what a collective would be (never dropped, merged, moved or fused).
NEVER_TOUCHED = Tag.register("NEVER_TOUCHED_IN_TEST")


class TagTrig(keraunos.Transform):
    """Tags the sin and cos lines of the computation with the new effect."""

    def transform_traces_pre_prologue(self, prologue, computation, epilogue):
        lines = [b.replace(tags=b.tags | {NEVER_TOUCHED})
                 if isinstance(b.symbol, TorchSymbol) and b.symbol.name.endswith(("sin", "cos"))
                 else b for b in computation.bound_symbols]
        return prologue, computation.derive(lines, "Tag Trig"), epilogue


def _calls(trace, suffix):
    return [b for b in trace.bound_symbols
            if isinstance(b.symbol, TorchSymbol) and b.symbol.name.endswith(suffix)]


def test_a_new_effect_is_one_table_entry_that_dce_cse_and_fusion_respect(monkeypatch):
    def f(x):
        x.sin()  # unread: DCE would drop it
        a, b = x.cos(), x.cos()  # identical: CSE would merge them
        return (a * b + 1).tanh() * 3 - 1

    x = torch.randn(16)
    plain = keraunos.jit(f, transforms=[TagTrig()], fuse="off")
    torch.testing.assert_close(plain(x), f(x))
    final = keraunos.last_traces(plain)[-1]
    assert len(_calls(final, "sin")) == 0 and len(_calls(final, "cos")) == 1  # no effect yet

    monkeypatch.setitem(effects.EFFECTS, NEVER_TOUCHED, effects.Effect())
    kept = keraunos.jit(f, transforms=[TagTrig()], executors=["inductor", "torch"], fuse="wait")
    torch.testing.assert_close(kept(x), f(x))
    final = keraunos.last_traces(kept)[-1]
    assert len(_calls(final, "sin")) == 1 and len(_calls(final, "cos")) == 2
    assert all(b.executor == "torch" for b in _calls(final, "sin") + _calls(final, "cos"))
    assert keraunos.last_fusions(kept), "the pointwise tail still fuses"
    for region in keraunos.last_fusions(kept):
        assert not [b for b in region.lines if NEVER_TOUCHED in b.tags]
