"""torch.compile(model, backend="keraunos"): dynamo splits at graph breaks, keraunos compiles each
subgraph. Every test compares with eager PyTorch."""
import copy
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import assert_grads_match, check_grads
import keraunos
import keraunos.dynamo as kd
from keraunos.dynamo.backend import BACKEND_MIN_SHARED_LAYERS


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # dynamo caches per code object: tests must not see each other's
    yield
    torch._dynamo.reset()


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


class BranchyNet(torch.nn.Module):
    """Graph breaks of three kinds: .item() driving a branch, a print, and a layerdrop test on
    torch.rand([]) in training."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.mean().item() > 0:  # graph break: item
            h = h * 1.5
        else:
            h = h - 0.5
        print("", end="")  # graph break: print
        if not self.training or torch.rand([]) > 0.3:  # graph break: layerdrop
            h = h + torch.nn.functional.gelu(self.b(h))
        return self.head(h).squeeze(-1)


def _train(model, step, xs, ys, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(step(x), y)
        loss.backward()
        losses.append(loss.detach())
        # A layer dropped this step has no gradient, in eager as here.
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads, torch.rand(4)  # the RNG stream after training


def _data(n=10):
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(5, 6, generator=g) for _ in range(n)],
            [torch.randn(5, generator=g) for _ in range(n)])


def test_forward_with_graph_breaks_matches_eager():
    torch.manual_seed(0)
    model = BranchyNet().eval()
    compiled = torch.compile(model, backend=kd.backend())
    for x in (torch.randn(5, 6), -torch.ones(5, 6) * 3, torch.randn(5, 6)):
        torch.testing.assert_close(compiled(x), model(x))


def _assert_trains_like_eager(backend, **tolerance):
    """Ten AdamW steps of BranchyNet (graph breaks, a layer dropped some steps) under
    ``backend``: every loss, gradient (or its absence), final weight and the random stream."""
    torch.manual_seed(0)
    eager_model = BranchyNet().train()
    compiled_model = copy.deepcopy(eager_model)
    compiled = torch.compile(compiled_model, backend=backend)
    xs, ys = _data()
    eager = _train(eager_model, eager_model, xs, ys)
    ours = _train(compiled_model, compiled, xs, ys)
    for a, b in zip(eager[0], ours[0]):
        torch.testing.assert_close(b, a, **tolerance)
    for ga, gb in zip(eager[1], ours[1]):
        for a, b in zip(ga, gb):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, **tolerance)
    assert any(g is None for step in eager[1] for g in step)  # a layer was dropped
    assert any(g is not None for g in eager[1][-1])
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b, a, **tolerance)
    torch.testing.assert_close(ours[2], eager[2])  # the same random numbers were drawn
    return compiled


def test_training_with_graph_breaks_matches_eager_for_ten_adamw_steps():
    _assert_trains_like_eager(kd.backend())


FUSED = ["inductor", "torch"]
FUSED_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # Inductor reorders reductions


def test_backend_with_fusion_trains_and_infers_through_graph_breaks_like_eager():
    """``backend(executors=["inductor", "torch"])``: the subgraphs between graph breaks get
    Inductor regions in their forward and backward traces, and give eager's results."""
    compiled = _assert_trains_like_eager(kd.backend(executors=FUSED, fuse="wait"), **FUSED_TOLERANCE)
    traces = kd.last_traces(compiled)
    assert any("inductor_region" in str(t.forward[-1]) for t in traces)
    assert any(t.backward and "inductor_region" in str(t.backward[-1]) for t in traces)
    model = _target_of(compiled).eval()
    with torch.no_grad():
        for x in (torch.randn(5, 6), -torch.ones(5, 6) * 3):
            torch.testing.assert_close(compiled(x), model(x), **FUSED_TOLERANCE)


def _target_of(compiled):
    return compiled._orig_mod


class Blocks(torch.nn.Module):
    def __init__(self, n=3, width=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
            for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x.sum(-1)


def test_backend_with_fusion_cuts_regions_at_layers_and_layers_share_one_kernel():
    """Dynamo's graph is flat; its nodes' module stacks say which layer each line came from, so
    identical layers make identical regions, compiled once (as under keraunos.jit), once the
    graph calls enough of them to pay for the cuts (BACKEND_MIN_SHARED_LAYERS)."""
    torch.manual_seed(0)
    model = Blocks(n=BACKEND_MIN_SHARED_LAYERS)
    be = kd.backend(executors=FUSED, fuse="wait")
    compiled_model = copy.deepcopy(model)
    x = torch.randn(2, 8, requires_grad=True)
    # Not out.sum(): its expanded gradient trips the fusion executor's restriding (see the
    # report of issue 12); a dense incoming gradient is what this test is about.
    weights = torch.randn(2)
    check_grads(compiled_model, x, ref=model, loss=lambda out: (out * weights).sum(),
                jit=torch.compile, backend=be, **FUSED_TOLERANCE)
    (subgraph,) = be.subgraphs
    for trace_name in ("computation", "backward"):
        layers = [r for r in keraunos.last_fusions(subgraph.jitted)
                  if r.trace_name == trace_name and r.layer is not None]
        assert sorted(r.layer for r in layers) == [
            f"layers.{i}" for i in range(BACKEND_MIN_SHARED_LAYERS)]
        assert len({r.kernel.number for r in layers}) == 1, trace_name


def test_backend_fuses_a_graph_of_few_layers_whole_where_keraunos_jit_cuts_it():
    """Two layers: each cut would cost every call a region call for one kernel shared once, so
    the backend compiles Dynamo's graph as one region, as Inductor does; keraunos.jit, whose
    users are promised fast compiles, still cuts at the layers. Both agree with eager."""
    torch.manual_seed(0)
    model = Blocks(n=2)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        be = kd.backend(executors=FUSED, fuse="wait")
        through_dynamo = torch.compile(copy.deepcopy(model), backend=be)
        torch.testing.assert_close(through_dynamo(x), expected, **FUSED_TOLERANCE)
        (subgraph,) = be.subgraphs
        regions = [r for r in keraunos.last_fusions(subgraph.jitted)
                   if r.trace_name == "computation"]
        assert len(regions) == 1 and regions[0].layer is None
        jitted = keraunos.jit(copy.deepcopy(model), executors=FUSED, fuse="wait")
        torch.testing.assert_close(jitted(x), expected, **FUSED_TOLERANCE)
        layers = sorted(r.layer for r in keraunos.last_fusions(jitted) if r.layer is not None)
        assert layers == ["layers.0", "layers.1"]


def test_subgraphs_that_need_gradients_have_forward_and_backward_traces():
    torch.manual_seed(0)
    model = BranchyNet().train()
    compiled = torch.compile(model, backend=kd.backend())
    compiled(torch.randn(5, 6)).sum().backward()
    traces = kd.last_traces(compiled)
    assert len(traces) >= 3
    with_params = [t for t in traces if "linear" in str(t.forward[-1])]
    assert with_params and all(t.backward for t in with_params)
    assert all(str(t.backward[-1]).count("def backward") == 1 for t in with_params)
    # Each line points at the user's source, not at dynamo's generated code.
    first = str(traces[0].forward[-1])
    assert f"{__file__}:{_line_of(BranchyNet.forward, 'torch.tanh')}:" in first
    assert "<eval_with_key>" not in first
    rng_graph = [t for t in traces if "torch.rand" in str(t.forward[-1])]
    assert rng_graph and not rng_graph[0].backward  # nothing in it needs a gradient
    # Static graphs: dynamo's guards check the inputs, keraunos's prologue only unpacks them.
    for t in traces:
        assert "return" not in str(t.prologue[-1]).split("def prologue", 1)[1].split("return (")[0]


def test_graph_breaks_are_listed_with_file_line_and_reason():
    torch.manual_seed(0)
    model = BranchyNet().train()
    compiled = torch.compile(model, backend="keraunos")
    compiled(torch.randn(5, 6))
    breaks = kd.graph_breaks(compiled)
    here = os.path.abspath(__file__)
    lines = {b.lineno for b in breaks if os.path.abspath(b.filename) == here}
    assert _line_of(BranchyNet.forward, "graph break: item") in lines
    assert _line_of(BranchyNet.forward, "graph break: print") in lines
    assert _line_of(BranchyNet.forward, "graph break: layerdrop") in lines
    assert any("item" in b.reason for b in breaks)
    assert any("print" in b.reason for b in breaks)
    assert all(str(b).startswith(f"{b.filename}:{b.lineno}: ") for b in breaks)


def _helper_with_a_break(h):
    h = h.sin()
    print("", end="")  # graph break inside a helper
    return h * 2


def test_graph_break_inside_a_helper_is_listed_and_its_subgraphs_found():
    def f(x):
        return _helper_with_a_break(x + 1) - 1
    compiled = torch.compile(f, backend="keraunos")
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), f(x))
    assert [b.lineno for b in kd.graph_breaks(compiled)] == [
        _line_of(_helper_with_a_break, "graph break inside")]
    forwards = "\n".join(str(t.forward[-1]) for t in kd.last_traces(compiled))
    for op in ("add(1)", "sin()", "mul(2)", "sub(1)"):
        assert op in forwards


def test_backend_by_name_from_a_fresh_process():
    code = ("import torch\n"
            "f = torch.compile(lambda x: (x * 2).sin(), backend='keraunos')\n"
            "x = torch.randn(3)\n"
            "torch.testing.assert_close(f(x), (x * 2).sin())\n"
            "import keraunos.dynamo as kd\n"
            "from torch._dynamo import list_backends\n"
            "assert 'keraunos' in list_backends(exclude_tags=())\n"
            "print(len(kd.last_traces(kd.backend_entry.__globals__['_DEFAULT'])))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_configured_backend_runs_executors_and_transforms():
    seen = []

    class Count(keraunos.Transform):
        def transform_trace_post_optimization(self, trace):
            seen.append(trace.name)
            return trace

    be = kd.backend(executors=["torch"], transforms=[Count()])
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    check_grads(lambda x, w: torch.relu(x @ w), x, w, jit=torch.compile, backend=be)
    assert seen == ["computation", "backward"]
    assert "Executor Claims [torch" in "\n".join(kd.last_traces(be)[0].forward[-1].header)


def test_sizes_that_dynamo_makes_dynamic_never_reuse_a_stale_entry():
    f = torch.compile(lambda x: x.sum(0) * x.shape[0], backend=kd.backend())
    for n in (2, 3, 4, 3, 2, 5):
        x = torch.randn(n, 3)
        torch.testing.assert_close(f(x), x.sum(0) * n)


def test_inputs_and_buffers_written_in_place_match_eager():
    torch.manual_seed(0)
    eager_model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    compiled_model = copy.deepcopy(eager_model)
    compiled = torch.compile(compiled_model, backend=kd.backend())
    for _ in range(3):
        x = torch.randn(8, 4)
        torch.testing.assert_close(compiled(x), eager_model(x))
    torch.testing.assert_close(compiled_model[1].running_mean, eager_model[1].running_mean)
    torch.testing.assert_close(compiled_model[1].running_var, eager_model[1].running_var)
    assert compiled_model[1].num_batches_tracked == eager_model[1].num_batches_tracked

    def bump(x, y):
        x.add_(1)
        return x * y
    a, b = torch.zeros(3), torch.zeros(3)
    y = torch.arange(3.0)
    torch.testing.assert_close(torch.compile(bump, backend=kd.backend())(a, y), bump(b, y))
    torch.testing.assert_close(a, b)


def _data_dependent(x):
    if x.sum() > 0:  # the line keraunos.jit cannot capture
        return x * 2
    return x - 1


def test_jit_error_on_data_dependent_decision_names_the_backend_route():
    with pytest.raises(keraunos.CaptureError) as info:
        keraunos.jit(_data_dependent, fallback="error")(torch.ones(3))
    message = str(info.value)
    assert 'torch.compile(model, backend="keraunos")' in message
    assert 'fallback="dynamo"' in message
    assert f"{__file__}:{_line_of(_data_dependent, 'cannot capture')}" in message


def test_jit_fallback_to_dynamo_warns_once_and_matches_eager():
    jf = keraunos.jit(_data_dependent, fallback=keraunos.Fallback.DYNAMO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (torch.ones(3), -torch.ones(3), torch.randn(3)):
            torch.testing.assert_close(jf(x), _data_dependent(x))
    fallbacks = [w for w in caught if "falls back" in str(w.message)]
    assert len(fallbacks) == 1
    line = _line_of(_data_dependent, "cannot capture")
    assert f"{__file__}:{line}" in str(fallbacks[0].message)
    assert "cost" in str(fallbacks[0].message)
    assert len(kd.last_traces(jf)) >= 2  # the subgraphs on both sides of the break
    assert [b.lineno for b in kd.graph_breaks(jf)] == [line]


def test_jit_fallback_trains_a_module_like_eager():
    torch.manual_seed(0)
    eager_model = BranchyNet().train()
    compiled_model = copy.deepcopy(eager_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jitted = keraunos.jit(compiled_model, fallback="dynamo")
        xs, ys = _data(3)
        eager = _train(eager_model, eager_model, xs, ys)
        ours = _train(compiled_model, jitted, xs, ys)
    for a, b in zip(eager[0], ours[0]):
        torch.testing.assert_close(b, a)
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(ours[2], eager[2])


def test_jit_fallback_is_a_typed_option():
    with pytest.raises(ValueError, match="fallback must be one of"):
        keraunos.jit(_data_dependent, fallback="inductor")
    with pytest.raises(keraunos.CaptureError):  # the default stays the error
        keraunos.jit(_data_dependent, fallback=keraunos.Fallback.ERROR)(torch.ones(3))


def test_a_graph_keraunos_cannot_compile_runs_eagerly_with_a_warning(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("an op capture does not handle")
    monkeypatch.setattr(keraunos.runtime.call, "compile_entry", refuse)
    f = torch.compile(lambda x: (x * 3).cos(), backend=kd.backend())
    x = torch.randn(4)
    with pytest.warns(UserWarning, match="runs eagerly.*an op capture does not handle"):
        torch.testing.assert_close(f(x), (x * 3).cos())
    torch.testing.assert_close(f(x + 1), ((x + 1) * 3).cos())  # and keeps doing so
    assert kd.last_traces(f) == []



def test_nested_vmap_inlined_by_dynamo_is_compiled_by_keraunos():
    # transformers builds its attention masks with nested vmaps; dynamo inlines them as explicit
    # functorch calls, which keraunos turns back into torch.vmap.
    def f(x, w):
        pairwise = torch.vmap(torch.vmap(lambda a, b: a * b + w.sum()))
        return pairwise(x, x + 1).sin() @ w

    x = torch.randn(2, 3)
    w = torch.randn(3, 3, requires_grad=True)
    w_eager = w.detach().clone().requires_grad_()
    compiled = torch.compile(f, backend=kd.backend())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs eagerly"
        out = compiled(x, w)
    expected = f(x, w_eager)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad)
    (traces,) = kd.last_traces(compiled)
    assert traces.backward


def test_dynamic_module_trains_like_eager_and_keeps_its_metadata_check():
    torch.manual_seed(0)
    eager_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled_model = copy.deepcopy(eager_model)
    compiled = torch.compile(compiled_model, backend="keraunos", dynamic=True)
    for n in (2, 5, 7, 5):
        x = torch.randn(n, 4)
        expected = eager_model(x).pow(2).mean()
        loss = compiled(x).pow(2).mean()
        torch.testing.assert_close(loss, expected)
        expected.backward()
        loss.backward()
        assert_grads_match(compiled_model, eager_model)
    (traces,) = kd.last_traces(compiled)  # a module without graph breaks: one subgraph
    assert traces.backward
    prologue = str(traces.prologue[-1])
    assert "tensors checked" in prologue and "shape (" in prologue


def test_a_static_subgraph_runs_its_computation_function_with_nothing_around_it():
    """Dynamo's guards already checked the inputs: once compiled, what dynamo calls for a graph
    that writes no input is keraunos's computation function itself (no lookup, no prologue)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    be = kd.backend()
    compiled = torch.compile(copy.deepcopy(model), backend=be)
    for _ in range(3):
        x = torch.randn(5, 4)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    subgraphs = be.subgraphs
    assert len(subgraphs) == 2  # one per grad mode: dynamo guards it
    for subgraph in subgraphs:
        assert subgraph.run is subgraph.jitted._keraunos.last_entry.computation_fn
    # the GraphModule's lazy code generation was not captured as writes to replay on every call
    assert "_code" not in str(subgraphs[0].jitted._keraunos.last_entry.epilogue_traces[-1])


def test_the_backend_fuses_three_pointwise_ops_and_dynamo_calls_the_program_directly():
    """The backend fuses graphs smaller than keraunos.jit does (three pointwise ops are cheaper
    as one kernel, which is what Inductor's route gives), in the background; once that is done,
    dynamo's call of the subgraph goes to the program itself (its class's ``__call__``), with
    no frame of keraunos's in between. An MLP's one relu is not fused."""
    def f(x):
        return (x * 2 + 1).relu()

    be = kd.backend(executors=["inductor", "torch"], fuse="background")
    compiled = torch.compile(f, backend=be)
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), f(x))
    (subgraph,) = be.subgraphs
    keraunos.wait_for_fusion(subgraph.jitted)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(compiled(x), f(x))
    assert "inductor_region" in str(subgraph.traces().forward[-1])
    entry = subgraph.jitted._keraunos.last_entry
    assert type(subgraph).__call__ is subgraph.run is entry.computation_fn
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    be = kd.backend(executors=["inductor", "torch"], fuse="background")
    compiled = torch.compile(copy.deepcopy(mlp), backend=be)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(compiled(x), mlp(x))
    (subgraph,) = be.subgraphs
    assert "inductor_region" not in str(subgraph.traces().forward[-1])


def test_a_subgraph_that_writes_an_input_still_checks_memory_shared_between_inputs():
    """A program that writes an input keeps keraunos's alias check on the lean path: inputs that
    share memory, unlike when it was compiled, are a keraunos cache miss and give eager's
    result (dynamo does not see sharing made with ``set_``, so its guards pass)."""
    def bump_then_multiply(a, b):
        a.add_(1)
        return a * b

    def overlapping():  # b's first two elements are a's last two
        base = torch.arange(8.0)
        return base[:4], torch.empty(0).set_(base.untyped_storage(), 2, (4,), (1,)), base

    be = kd.backend()
    compiled = torch.compile(bump_then_multiply, backend=be)
    torch.testing.assert_close(compiled(torch.zeros(4), torch.ones(4)),
                               bump_then_multiply(torch.zeros(4), torch.ones(4)))
    for _ in range(2):
        a, b, base = overlapping()
        eager_a, eager_b, eager_base = overlapping()
        torch.testing.assert_close(compiled(a, b), bump_then_multiply(eager_a, eager_b))
        torch.testing.assert_close(base, eager_base)
    (subgraph,) = be.subgraphs
    assert keraunos.cache_misses(subgraph.jitted) == 2  # the overlap was compiled for


def test_a_subgraph_returning_views_skips_its_prologue_and_keeps_eagers_aliasing():
    """The epilogue that rebuilds returned views of intermediates still runs on the lean path
    (without the prologue, which would only pass dynamo's arguments through): the views alias
    what eager's do."""
    def views(x):
        y = x * 2
        return y[1:], y.view(-1), y

    be = kd.backend()
    compiled = torch.compile(views, backend=be)
    for _ in range(3):
        x = torch.randn(3, 4)
        got, want = compiled(x), views(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        assert got[0]._base is got[2] and got[1]._base is got[2]
        assert [g._is_view() for g in got] == [w._is_view() for w in want]
    (subgraph,) = be.subgraphs
    assert subgraph.run.__name__ == "computation_epilogue"


class SlicedLayers(torch.nn.Module):
    """transformers' decoders run ``self.layers[: config.num_hidden_layers]``: a ModuleList built
    in forward, whose registrations call the global module registration hooks (keraunos has one)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = torch.tanh(layer(x))
        return x


class WithSlicedLayers(torch.nn.Module):
    """As a causal LM holds its decoder (the break showed only in a submodule's forward)."""

    def __init__(self):
        super().__init__()
        self.model = SlicedLayers()

    def forward(self, x):
        return self.model(x) * 2


def test_module_built_in_forward_is_no_graph_break_and_jit_still_sees_registrations():
    """keraunos's registration hook is traced by dynamo into every forward that builds a module;
    it must not break the graph (it did: `object()`), for any backend, and it must still make a
    jitted module see a module registered later."""
    torch.manual_seed(0)
    model = WithSlicedLayers()
    assert torch._dynamo.explain(model)(torch.randn(2, 4)).graph_break_count == 0
    compiled = torch.compile(copy.deepcopy(model), backend=kd.backend())
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    assert kd.graph_breaks(compiled) == [] and len(kd.last_traces(compiled)) == 1
    jmodel = keraunos.jit(model)
    before = jmodel(x)
    torch.testing.assert_close(before, model(x))
    model.model.layers[0] = torch.nn.Linear(4, 4)  # a registration: the jitted module must see it
    after = jmodel(x)
    torch.testing.assert_close(after, model(x))
    assert not torch.allclose(after, before)
