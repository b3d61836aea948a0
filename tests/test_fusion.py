"""The inductor fusion executor against eager PyTorch.

``executors=["inductor", "torch"]`` compiles regions of the trace with TorchInductor. Inductor is
not bitwise equal to eager (it reorders reductions and fuses elementwise math), so values are
compared at rtol = atol = 1e-4 in float32; everything else a caller can see is compared exactly:
in-place effects on inputs and buffers, returned views and their memory sharing, the random
stream under ``torch.manual_seed``, strides, gradients.

Compiles take seconds each on a small CPU, so compiled models are shared by module-scoped
fixtures and the shapes are small; Inductor's on-disk cache makes reruns faster.
"""
import copy
import os
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from helpers import assert_grads_match, check_grads
import keraunos
import keraunos.dynamo
from keraunos.examples.gpt import GPT, GPTConfig
from keraunos.executors import fusion
from keraunos.executors.fusion import collecting, compiler, patches
from keraunos.runtime.call import state_of

FUSED = ["inductor", "torch"]
TOL = dict(rtol=1e-4, atol=1e-4)


def executors_of(trace):
    return [b.executor for b in trace.bound_symbols]


def fusion_lines(trace):
    return [b for b in trace.bound_symbols if isinstance(b.symbol, fusion.FusionSymbol)]


# ----------------------------------------------------------------------------- GPT, inference
@pytest.fixture(scope="module")
def gpt_inference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).eval()
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    idx = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        out = jitted(idx)
    return model, jitted, idx, out


def test_gpt_inference_matches_eager(gpt_inference):
    model, jitted, idx, out = gpt_inference
    with torch.no_grad():
        assert_close(out, model(idx), **TOL)
        other = torch.randint(0, 256, (2, 8))  # the cached entry, its kernels called directly
        assert_close(jitted(other), model(other), **TOL)
    assert keraunos.cache_misses(jitted) == 1


def test_gpt_layers_share_one_kernel(gpt_inference):
    _, jitted, _, _ = gpt_inference
    regions = keraunos.last_fusions(jitted)
    layers = [r for r in regions if r.layer is not None]
    assert [r.layer for r in layers] == ["h.0", "h.1"]
    assert layers[0].kernel is layers[1].kernel
    assert layers[0].shared_with is None and layers[1].shared_with == layers[0].name
    assert f"(the kernel of {layers[0].name})" in str(keraunos.last_traces(jitted)[-1])


def test_gpt_trace_shows_region_lines_and_calls(gpt_inference):
    _, jitted, _, _ = gpt_inference
    trace = keraunos.last_traces(jitted)[-1]
    text = str(trace)
    region = keraunos.last_fusions(jitted)[1]
    # Its inputs, handed over in a list where some are last used there (glue.HandOver)
    assert f"= {region.name}({', '.join(region.inputs)})" in text or (
        f"{region.name}_inputs = [{', '.join(region.inputs)}]" in text
        and f"= {region.name}.take({region.name}_inputs)" in text)
    assert "#   t4 = torch.nn.functional.layer_norm(" in text  # its lines, as comments
    assert "torch" not in executors_of(trace)  # every op of this model is in a region


def test_last_fusions_lists_graph_and_generated_code(gpt_inference):
    _, jitted, _, _ = gpt_inference
    region = keraunos.last_fusions(jitted)[1]
    assert region.inputs[0] == "t3" and region.outputs == ["t24"]
    assert "def forward(self, i0, i1" in region.graph.code
    assert "def call(" in region.kernel_code
    assert os.path.isfile(region.kernel_path)
    assert "def inductor_region1(" in str(region.trace)
    assert region.name in region.source and region.kernel_code in region.source


def test_region_trace_runs_like_the_region(gpt_inference):
    model, jitted, idx, _ = gpt_inference
    region = keraunos.last_fusions(jitted)[1]
    x = torch.randn(2, 8, 64)
    block = model.h[0]
    params = [block.ln_1.weight, block.ln_1.bias, block.attn.qkv.weight, block.attn.qkv.bias,
              block.attn.proj.weight, block.attn.proj.bias, block.ln_2.weight, block.ln_2.bias,
              block.mlp.fc.weight, block.mlp.fc.bias, block.mlp.proj.weight, block.mlp.proj.bias]
    with torch.no_grad():
        (by_trace,) = region.trace.python_callable()(x, *params)
        assert_close(by_trace, block(x))
        assert_close(region.kernel.fn(x, *params)[0], block(x), **TOL)


def test_debug_dump_and_report_show_fusion_regions(gpt_inference, tmp_path):
    from keraunos import debug
    _, jitted, _, _ = gpt_inference
    entry = state_of(jitted).last_entry
    debug.write_fusion_kernels(str(tmp_path), entry)
    written = sorted(os.listdir(tmp_path / "fusion"))
    assert len(written) == len(keraunos.last_fusions(jitted)) and "inductor_region1" in written[1]
    page = open(keraunos.report(jitted, str(tmp_path / "r.html"))).read()
    assert "Fusion regions" in page and "inductor_region1" in page


# ----------------------------------------------------------------------------- GPT, training
@pytest.fixture(scope="module")
def gpt_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    idx = torch.randint(0, 256, (2, 8))
    return model, reference, jitted, idx


def test_gpt_training_step_matches_eager(gpt_training):
    model, reference, jitted, idx = gpt_training
    for step in range(2):
        for m in (model, reference):
            m.zero_grad()
        logits, loss = jitted(idx, idx)
        loss.backward()
        ref_logits, ref_loss = reference(idx, idx)
        ref_loss.backward()
        assert_close(logits, ref_logits, **TOL)
        assert_close(loss, ref_loss, **TOL)
        assert_grads_match(model, reference, **TOL)
    assert keraunos.cache_misses(jitted) == 1


def test_gpt_backward_layers_share_one_kernel(gpt_training):
    _, _, jitted, idx = gpt_training
    jitted(idx, idx)
    backward = [r for r in keraunos.last_fusions(jitted) if r.trace_name == "backward"]
    layers = [r for r in backward if r.layer is not None]
    assert [r.layer for r in layers] == ["h.1", "h.0"]  # the backward runs the layers in reverse
    assert layers[0].kernel is layers[1].kernel
    assert fusion_lines(keraunos.last_backward_traces(jitted)[-1])


# ----------------------------------------------------------------------------- N identical layers
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x))) * 0.5


class Stack(nn.Module):
    def __init__(self, n, width=16):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(n))
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (x * self.scale).sum(-1)


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    model = Stack(4)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    x = torch.randn(3, 16, requires_grad=True)
    out = jitted(x)
    return model, jitted, x, out


def test_modulelist_layers_compile_one_region(stack):
    model, jitted, x, out = stack
    assert_close(out, model(x), **TOL)
    for trace_name in ("computation", "backward"):
        layers = [r for r in keraunos.last_fusions(jitted)
                  if r.trace_name == trace_name and r.layer is not None]
        assert len(layers) == 4, trace_name
        assert len({id(r.kernel) for r in layers}) == 1, trace_name


def test_modulelist_gradients_match_eager(stack):
    model, jitted, x, _ = stack
    model.zero_grad()
    reference = copy.deepcopy(model)
    x1 = x.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(3)
    jitted(x1).backward(grad)
    reference(x2).backward(grad)
    assert_close(x1.grad, x2.grad, **TOL)
    assert_grads_match(model, reference, **TOL)


class _Widening(nn.Module):
    """Two stages of layers of one class, as a convnet's: at widths 16 and 16 (alike), then 16
    to 32 and 32 to 64 (of one class, but not alike)."""

    def __init__(self):
        super().__init__()

        def layer(i, o):
            return nn.Sequential(nn.LayerNorm(i), nn.Linear(i, o), nn.Tanh())
        self.first = nn.ModuleList([layer(16, 16), layer(16, 16)])
        self.second = nn.ModuleList([layer(16, 32), layer(32, 64)])

    def forward(self, x):
        for layer in [*self.first, *self.second]:
            x = layer(x)
        return x.sum(-1) * 0.5


def test_only_alike_layers_are_cut_into_regions_of_their_own():
    """Regions are cut at layers so that alike layers (the same ops on the same shapes) share a
    kernel; layers of one class none of which are alike share nothing, and stay in the region
    around them: the two 16-wide layers are a region each (one kernel between them in the
    forward), and the 32- and 64-wide ones are one region with what follows. Values and
    gradients are eager's, forward and backward."""
    torch.manual_seed(0)
    model = _Widening()
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    for _ in range(2):
        x = torch.randn(3, 16, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        model.zero_grad(), reference.zero_grad()
        out, expected = jitted(x), reference(x_ref)
        assert_close(out, expected, **TOL)
        grad = torch.randn(3)
        out.backward(grad)
        expected.backward(grad)
        assert_close(x.grad, x_ref.grad, **TOL)
        assert_grads_match(model, reference, **TOL)
    for trace_name in ("computation", "backward"):
        regions = [r for r in keraunos.last_fusions(jitted) if r.trace_name == trace_name]
        layers = [r for r in regions if r.layer is not None]
        assert sorted(r.layer for r in layers) == ["first.0", "first.1"], trace_name
        assert len(regions) == 3, (trace_name, [r.layer for r in regions])
    forward = [r for r in keraunos.last_fusions(jitted) if r.trace_name == "computation"]
    assert forward[0].kernel is forward[1].kernel  # (in the backward the first layer's region
    # differs from the second's: the gradient of its tanh is computed in the second's)


def test_layers_of_one_class_are_cut_where_some_of_them_are_alike():
    """``layers_of_stacks``: a parent's children of one class are layers when at least
    ``min_repeats`` of them recorded the same ops on the same shapes (then all of them are)."""
    from keraunos.executors.fusion import layers
    torch.manual_seed(0)
    jitted = keraunos.jit(_Widening(), executors=FUSED, fuse="wait")
    with torch.no_grad():
        jitted(torch.randn(3, 16))
    lines = keraunos.last_traces(jitted)[0].bound_symbols
    assert layers.layers_of_stacks(lines) == {"first.0", "first.1"}
    assert layers.layers_of_stacks(lines, min_repeats=3) == set()
    jitted = keraunos.jit(Stack(3), executors=FUSED, fuse="wait")
    with torch.no_grad():
        jitted(torch.randn(3, 16))
    lines = keraunos.last_traces(jitted)[0].bound_symbols
    assert layers.layers_of_stacks(lines, min_repeats=3) == {"layers.0", "layers.1", "layers.2"}


def test_incoming_gradient_with_other_strides(stack):
    model, jitted, x, _ = stack
    # Strides 2 and 0 where the backward was compiled for 1 (``.sum().backward()`` expands).
    for grad in (torch.randn(6)[::2], torch.randn(1).expand(3)):
        model.zero_grad()
        reference = copy.deepcopy(model)
        x1 = x.detach().clone().requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        jitted(x1).backward(grad)
        reference(x2).backward(grad)
        assert_close(x1.grad, x2.grad, **TOL)
        assert_grads_match(model, reference, **TOL)


def test_identical_model_reuses_kernels_across_jits(stack):
    torch.manual_seed(1)
    other = Stack(4)
    jitted = keraunos.jit(other, executors=FUSED, fuse="wait")
    x = torch.randn(3, 16, requires_grad=True)
    assert_close(jitted(x), other(x), **TOL)
    layers = [r for r in keraunos.last_fusions(jitted) if r.layer is not None]
    assert all(r.shared_with is not None for r in layers)
    assert keraunos.compile_stats(jitted).stages["fusion"] < 5.0  # no Inductor compile


# ----------------------------------------------------------------------------- exact semantics
def test_inplace_update_of_input_and_buffer_matches_eager():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x, cache):
            y = torch.relu(x * 2 + 1).sin()
            self.total.add_(y.sum(0))
            cache[0] = y[0] * 3  # a write into an input, as a KV cache does
            return (y * y).exp()

    eager, jit_model = Counter(), Counter()
    jitted = keraunos.jit(jit_model, executors=FUSED, fuse="wait")
    for _ in range(2):
        x = torch.randn(3, 4)
        c1, c2 = torch.zeros(2, 4), torch.zeros(2, 4)
        assert_close(jitted(x, c1), eager(x, c2), **TOL)
        assert_close(c1, c2, **TOL)
        assert_close(jit_model.total, eager.total, **TOL)
    assert fusion_lines(keraunos.last_traces(jitted)[-1])


class CachedAttention(nn.Module):
    """Attention over a key/value cache written in place, as generation does."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("k_cache", torch.zeros(1, 8, 16))
        self.register_buffer("v_cache", torch.zeros(1, 8, 16))

    def forward(self, x, pos):
        q, k, v = self.qkv(x).split(16, dim=-1)
        self.k_cache.index_copy_(1, pos, k)
        self.v_cache.index_copy_(1, pos, v)
        scores = torch.softmax(q @ self.k_cache.transpose(1, 2) * 0.25, dim=-1)
        return torch.tanh(scores @ self.v_cache) * 2


def test_kv_cache_written_in_place_matches_eager():
    torch.manual_seed(0)
    eager = CachedAttention().eval()
    jit_model = copy.deepcopy(eager)
    jitted = keraunos.jit(jit_model, executors=FUSED, fuse="wait")
    with torch.no_grad():
        steps = [(torch.randn(1, 3, 16), torch.arange(3))] + [
            (torch.randn(1, 1, 16), torch.tensor([t])) for t in range(3, 6)]
        for x, pos in steps:
            versions = jit_model.k_cache._version, eager.k_cache._version
            assert_close(jitted(x, pos), eager(x, pos), **TOL)
            assert_close(jit_model.k_cache, eager.k_cache, **TOL)
            assert_close(jit_model.v_cache, eager.v_cache, **TOL)
            # one write a call, as eager counts it (autograd compares saved versions)
            assert jit_model.k_cache._version - versions[0] == eager.k_cache._version - versions[1]
    # The writes run inside the region, which reads the caches after them: one kernel per step.
    trace = keraunos.last_traces(jitted)[-1]
    (line,) = fusion_lines(trace)
    assert not [b for b in trace.bound_symbols if b.symbol.name == "index_copy_"]
    assert [b.symbol.name for b in line.subsymbols].count("index_copy_") == 2
    assert line.symbol.region.written == ["k_cache_updated", "v_cache_updated"]
    assert "writes k_cache_updated, v_cache_updated in place" in str(trace)


def test_a_region_writing_a_kv_cache_is_called_past_the_wrappers():
    """A region that writes a KV cache calls Inductor's graph directly after its first call
    (the decode step of the torch.compile backend paid AOTAutograd's wrappers per layer): each
    later call writes the caches once, as eager does, and counts one write in their version
    counters; its outputs are eager's."""
    torch.manual_seed(0)
    eager = CachedAttention().eval()
    jit_model = copy.deepcopy(eager)
    jitted = keraunos.jit(jit_model, executors=FUSED, fuse="wait")
    with torch.no_grad():
        for t in range(4):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            versions = jit_model.v_cache._version, eager.v_cache._version
            assert_close(jitted(x, pos), eager(x, pos), **TOL)
            assert_close(jit_model.k_cache, eager.k_cache, **TOL)
            assert_close(jit_model.v_cache, eager.v_cache, **TOL)
            assert jit_model.v_cache._version - versions[0] == eager.v_cache._version - versions[1]
    (line,) = fusion_lines(keraunos.last_traces(jitted)[-1])
    assert line.symbol.call.kernel_fn is not line.symbol.call.kernel.compiled


def _append_to_cache(cache, length, x):
    """A static cache that keeps its own length, as transformers' StaticCache does from 5.2x:
    the positions written come from the length, which the same call then advances."""
    pos = length + torch.arange(x.shape[0])
    cache.index_copy_(0, pos, x)
    length.add_(x.shape[0])
    return (cache * 2).sum(0), pos


def test_a_region_that_reads_the_input_it_writes_is_checked_on_the_values_before_its_write():
    """The first call of a region that writes its inputs runs Inductor's graph a second time
    to see whether it can be called past the wrappers; that second run computes from copies of
    the written inputs as they were before the first call, not from the values the first call
    left (here the advanced length, whose positions lie past the cache's end)."""
    jitted = keraunos.jit(_append_to_cache, executors=FUSED, fuse="wait")
    for _ in range(3):  # each call fills a fresh cache to its last row
        x = torch.randn(2, 4)
        cache, length = torch.zeros(2, 4), torch.zeros((), dtype=torch.long)
        cache_ref, length_ref = torch.zeros(2, 4), torch.zeros((), dtype=torch.long)
        assert_close(jitted(cache, length, x), _append_to_cache(cache_ref, length_ref, x))
        assert_close(cache, cache_ref)
        assert_close(length, length_ref)
    (line,) = fusion_lines(keraunos.last_traces(jitted)[-1])
    assert line.symbol.region.written == ["length_updated", "cache_updated"]
    assert line.symbol.call.kernel_fn is not line.symbol.call.kernel.compiled


def test_batchnorm_training_statistics_and_gradients_match_eager():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 4))
    jit_model = copy.deepcopy(eager)
    jitted = keraunos.jit(jit_model, executors=FUSED, fuse="wait")
    for _ in range(2):
        x = torch.randn(6, 8)
        out, ref = jitted(x), eager(x)
        assert_close(out, ref, **TOL)
        (out * out).sum().backward()
        (ref * ref).sum().backward()
        for a, b in zip(jit_model.buffers(), eager.buffers()):
            assert_close(a, b, **TOL)
        assert_grads_match(jit_model, eager, **TOL)
    assert fusion_lines(keraunos.last_backward_traces(jitted)[-1])


def test_batchnorm_gradients_of_a_deep_fused_stack_are_as_close_to_float64_as_eagers():
    """Six conv-BN-ReLU blocks in training: the fused program's gradients are within three
    times eager float32's own distance from a float64 run (the model sweep's rule). BatchNorm's
    backward sums run on eager's kernel, outside regions; fused, the later blocks' BatchNorm
    gradients were 4-5x eager's distance."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                            nn.ReLU()) for _ in range(6)]
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *blocks, nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def gradients(m, x):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        return {name: p.grad.double() for name, p in m.named_parameters()}
    exact = gradients(copy.deepcopy(model).double(), x.double())
    eager = gradients(copy.deepcopy(model), x)
    jitted = keraunos.jit(copy.deepcopy(model), fuse="wait")
    gradients(jitted, x)
    fused = gradients(jitted, x)
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert fusion_lines(keraunos.last_backward_traces(jitted)[-1])

    def distance(a, b):
        return (a - b).square().mean().sqrt().item()
    for name in exact:
        assert distance(fused[name], exact[name]) <= 3 * distance(eager[name], exact[name]), name


def test_batchnorm_statistics_in_a_region_are_as_close_to_float64_as_eagers():
    """BatchNorm's training statistics on data far from zero (a mean of 100, a spread of 0.01):
    eager's kernel sums each channel in float64; Inductor's float32 Welford accumulator was 1.7x
    eager's distance from float64 on the mean and 900x on the variance. Accumulated in float64
    in the region, the mean is eager's (the same rounding of the same sum) and the variance and
    the output at most eager's distance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(16, momentum=1.0), nn.ReLU())  # running = this batch's
    x = 100 + torch.randn(8, 16, 12, 12) * 0.01

    def run(m, x):
        return m(x), m[0].running_mean.clone(), m[0].running_var.clone()
    exact = run(copy.deepcopy(model).double(), x.double())
    eager = run(copy.deepcopy(model), x)
    jitted = keraunos.jit(copy.deepcopy(model), fuse="wait")
    fused = run(jitted, x)
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert fusion_lines(keraunos.last_traces(jitted)[-1])
    assert_close(fused[1], eager[1], rtol=0, atol=0)  # the mean: eager's to the bit

    def distance(a, b):
        return (a.double() - b).abs().max().item()
    for name, f, e, r in zip(("output", "mean", "variance"), fused, eager, exact):
        assert distance(f, r) <= distance(e, r), name


@pytest.mark.parametrize("fuse", ["off", "wait"])
@pytest.mark.parametrize("training", [True, False])
def test_a_batchnorm_of_a_transposed_input_is_laid_out_as_eagers(fuse, training):
    """Eager's CPU kernel makes its output in the input's suggested memory format (contiguous
    for a transposed (N, C) input); PyTorch's fake kernel keeps the input's strides, and a region
    returned those. Outputs, the result of a following op and the input's gradient: eager's
    values and strides."""
    torch.manual_seed(0)
    model = nn.BatchNorm1d(8).train(training)
    jitted = keraunos.jit(copy.deepcopy(model), fuse=fuse)

    def run(m, x):
        x = x.clone().requires_grad_()
        y = m(x.t())
        z = y * 2 + 1
        (z * torch.arange(8.0)).sum().backward()
        return y, z, x.grad
    x = torch.randn(8, 16)
    for _ in range(2):  # the first call captures, the second runs the cached program
        for got, want in zip(run(jitted, x), run(model, x)):
            assert_close(got, want)
            assert got.stride() == want.stride()
    assert_close(jitted.running_mean, model.running_mean)


def test_bias_gradients_summed_in_a_fused_backward_are_as_close_to_float64_as_eagers():
    """A Linear's bias gradient sums the output gradient's rows (``grad.sum(0)``). Inductor's
    CPU kernel adds the 4096 rows to one accumulator per column in order: 8x eager's distance
    from a float64 run, whose kernel sums in a cascade. Accumulated in float64 it is within
    eager's; the weights' gradients (matrix products) are eager's kernels anyway."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
    x, w = torch.randn(4096, 32) + 0.5, torch.randn(4096, 64)

    def gradients(m, x, w):
        m.zero_grad(set_to_none=True)
        (m(x) * w).square().sum().backward()
        return {name: p.grad.double() for name, p in m.named_parameters()}
    exact = gradients(copy.deepcopy(model).double(), x.double(), w.double())
    eager = gradients(copy.deepcopy(model), x, w)
    jitted = keraunos.jit(copy.deepcopy(model), fuse="wait")
    fused = gradients(jitted, x, w)
    backward = keraunos.last_backward_traces(jitted)[-1]
    outside = [line for line in str(backward).splitlines()
               if not line.lstrip().startswith("#") and ".sum" in line]
    assert fusion_lines(backward) and not outside, outside  # the sums ran in regions
    for name in ("0.bias", "2.bias"):
        error = (fused[name] - exact[name]).abs().max().item()
        assert error <= (eager[name] - exact[name]).abs().max().item(), name


@pytest.mark.parametrize("reduce", ["sum", "mean", "mean of two dims"])
def test_column_sums_and_means_in_regions_are_as_close_to_float64_as_eagers(reduce):
    def f(x):
        y = x * 1.0001
        if reduce == "sum":
            return y.sum(0)
        return y.mean(0) if reduce == "mean" else torch.mean(y, dim=[0, 1], keepdim=True)
    torch.manual_seed(0)
    x = torch.randn(8192, 64) + 0.3  # Inductor's row-by-row sums: 13-25x eager's error
    x = x.view(64, 128, 64) if reduce == "mean of two dims" else x
    exact = f(x.double())
    jitted = keraunos.jit(f, fuse="wait")
    got = jitted(x)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert fusion_lines(keraunos.last_traces(jitted)[-1])
    assert (got.double() - exact).abs().mean() <= (f(x).double() - exact).abs().mean()


def test_regions_are_called_past_inductors_wrappers():
    """After its first call a region calls Inductor's graph directly (the wrappers cost as much
    as a small kernel), BatchNorm's too, whose graph writes the running statistics (it was
    compared on copies of them, so that they are written once); grad mode on takes the
    wrappers. Every call gives eager's values and statistics."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Tanh())
    jit_model = copy.deepcopy(eager)
    jitted = keraunos.jit(jit_model, executors=FUSED, fuse="wait")
    for grad in (False, False, True, False):
        x = torch.randn(6, 8)
        with torch.set_grad_enabled(grad):
            assert_close(jitted(x), eager(x), **TOL)
        for a, b in zip(jit_model.buffers(), eager.buffers()):
            assert_close(a, b, **TOL)
    calls = {tuple(b.symbol.name for b in fl.subsymbols): fl.symbol.call
             for fl in fusion_lines(keraunos.last_traces(jitted)[-1])}
    assert any("batch_norm" in " ".join(lines) for lines in calls)
    assert all(call.kernel_fn is not call.kernel.compiled for call in calls.values())
    pure = keraunos.jit(lambda x: (x * 2).sin().cos() + 1, executors=FUSED, fuse="wait")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 4)
            assert_close(pure(x), (x * 2).sin().cos() + 1, **TOL)
    (line,) = fusion_lines(keraunos.last_traces(pure)[-1])
    assert line.symbol.call.kernel_fn is not line.symbol.call.kernel.compiled


def test_a_region_whose_inputs_need_no_grad_is_called_past_the_wrappers_in_grad_mode():
    """In grad mode too, a region none of whose inputs requires grad (which the prologue
    checks) calls Inductor's graph directly: with no input requiring grad, grad mode changes
    nothing the graph computes. Its outputs are eager's and, as eager's, require no grad; the
    same program on an input that requires grad runs its region in the forward of its
    ``autograd.Function`` and gives eager's gradients."""
    def f(x):
        return (x * 2).sin().cos() + 1

    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    for _ in range(3):
        x = torch.randn(4, 4)
        got = jitted(x)
        assert_close(got, f(x), **TOL)
        assert not got.requires_grad
    (line,) = fusion_lines(keraunos.last_traces(jitted)[-1])
    call = line.symbol.call
    assert call.grad_free and call.kernel_fn is not call.kernel.compiled
    assert call.kernel_fn.__name__ == "call"  # not the variant that looks at grad mode
    for _ in range(2):
        x = torch.randn(4, 4, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        got, want = jitted(x), f(x_eager)
        assert_close(got, want, **TOL)
        got.sum().backward()
        want.sum().backward()
        assert_close(x.grad, x_eager.grad, **TOL)
    (line,) = fusion_lines(keraunos.last_traces(jitted)[-1])
    assert not line.symbol.call.grad_free


def test_region_kernels_leave_layout_checks_to_the_prologue():
    """Inductor's code checks no input's sizes and strides on each call (``size_asserts`` off:
    40 us of a 300 us call of a two-layer model); the prologue does. An input of another layout
    is a cache miss and a new entry, never a kernel reading memory laid out otherwise."""
    fn = keraunos.jit(lambda x, w: torch.tanh(x @ w).exp() + x, executors=FUSED, fuse="wait")
    w = torch.randn(8, 8)
    for x in (torch.randn(8, 8), torch.randn(8, 8).t(), torch.randn(8, 16)[:, ::2]):
        with torch.no_grad():
            assert_close(fn(x, w), torch.tanh(x @ w).exp() + x, **TOL)
    assert keraunos.cache_misses(fn) == 3
    codes = [r.kernel_code for r in keraunos.last_fusions(fn)]
    assert codes and all("def call(" in c and "assert_size_stride(arg" not in c for c in codes)


def test_transposing_attributes_join_regions_and_tensor_attributes_stay_out():
    """``w.T`` and ``v.mT`` (Falcon's ``input @ self.weight.T``) are views a region computes;
    outside a region each is a Python call per layer and per weight. ``x.grad`` reads the tensor
    object, which a compiled graph cannot: it stays a line of its own."""
    def f(x, w, v):
        return (x @ w.T).relu() @ v.mT + 1

    torch.manual_seed(0)
    x, w, v = torch.randn(4, 8), torch.randn(16, 8, requires_grad=True), torch.randn(8, 16)
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    with torch.no_grad():
        for _ in range(2):
            assert_close(jitted(x, w, v), f(x, w, v), **TOL)
    trace = keraunos.last_traces(jitted)[-1]
    (line,) = fusion_lines(trace)
    assert {b.symbol.name for b in line.subsymbols} >= {"T", "mT"}
    assert not [b for b in trace.bound_symbols if b.symbol.name in ("T", "mT")]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    jitted(x1, w, v).sum().backward()
    f(x2, w2, v).sum().backward()
    assert_close(x1.grad, x2.grad, **TOL)
    assert_close(w.grad, w2.grad, **TOL)

    def g(x):
        return x.grad * 2 + 1

    y = torch.randn(4, requires_grad=True)
    y.grad = torch.randn(4)
    grad_of = keraunos.jit(g, executors=FUSED, fuse="wait")
    with torch.no_grad():
        assert_close(grad_of(y), g(y), **TOL)
        # x.grad is an input of its own, which the prologue reads on every call: never a line.
        assert "from args[0].grad:" in str(keraunos.last_prologue_traces(grad_of)[-1])
        y.grad = torch.randn(4)
        assert_close(grad_of(y), g(y), **TOL)
    assert keraunos.cache_misses(grad_of) == 1


def test_returned_views_share_memory_as_in_eager():
    def f(x):
        y = torch.tanh(x * 2) + 1
        return y, y.t(), y[0], x.view(-1)

    x = torch.randn(3, 4)
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    out, ref = jitted(x), f(x)
    for a, b in zip(out, ref):
        assert_close(a, b, **TOL)
        assert a.stride() == b.stride()
    storage = out[0].untyped_storage().data_ptr()
    assert out[1].untyped_storage().data_ptr() == storage
    assert out[2].untyped_storage().data_ptr() == storage
    assert out[3]._base is x


def test_output_strides_are_the_traced_ones():
    def f(x):
        y = (x * 3).exp().permute(2, 0, 1)
        return y * 2, y.sum(0, keepdim=True)

    x = torch.randn(2, 3, 5)
    out, ref = keraunos.jit(f, executors=FUSED, fuse="wait")(x), f(x)
    for a, b in zip(out, ref):
        assert_close(a, b, **TOL)
        assert a.stride() == b.stride()


class _RotaryAttention(nn.Module):
    """litgpt's attention in small: the rotary embedding joins each head's rotated half with an
    empty rest (``torch.cat((roped, q[..., 16:]), -1)``), then attention, then a projection."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(32, 96, bias=False), nn.Linear(32, 32, bias=False)

    def forward(self, x, cos, sin):
        def rope(t):
            half = torch.cat((-t[..., 8:16], t[..., :8]), dim=-1)
            return torch.cat((t[..., :16] * cos + half * sin, t[..., 16:]), dim=-1)
        q, k, v = (t.view(2, 10, 2, 16).transpose(1, 2) for t in self.qkv(x).split(32, dim=-1))
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(2, 10, 32))


def test_a_cat_of_one_non_empty_tensor_keeps_the_traced_layout_and_eagers_gradients():
    """Inductor clones the one non-empty tensor of a ``cat`` in its own layout; the region's graph
    asks for eager's, so its outputs (query, key, attention output, saved for the backward) come
    back as the trace says, with no copy after the call, and values and gradients are eager's."""
    torch.manual_seed(0)
    x = torch.randn(2, 10, 32, requires_grad=True)
    cos, sin = torch.randn(10, 16), torch.randn(10, 16)
    jitted = check_grads(_RotaryAttention(), x, cos, sin, executors=FUSED, fuse="wait",
                         **TOL)
    calls = [fl.symbol.call for fl in fusion_lines(keraunos.last_traces(jitted)[-1])]
    assert calls and all(c.fixed_outputs == () and c.copied_outputs == () for c in calls)
    clones = [n for r in keraunos.last_fusions(jitted) if r.trace_name == "computation"
              for n in r.graph.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert [n.kwargs["memory_format"] for n in clones] == [torch.contiguous_format] * 2


def test_a_cat_of_one_non_empty_tensor_used_inside_the_region_is_left_to_inductor():
    """Under no_grad the query and key stay inside the region: the ``cat`` stays, and Inductor
    lays it out as it finds best; the values are eager's."""
    torch.manual_seed(0)
    model = _RotaryAttention()
    x, cos, sin = torch.randn(2, 10, 32), torch.randn(10, 16), torch.randn(10, 16)
    jitted = keraunos.jit(copy.deepcopy(model), executors=FUSED, fuse="wait")
    with torch.no_grad():
        assert_close(jitted(x, cos, sin), model(x, cos, sin), **TOL)
    graphs = [r.graph.graph for r in keraunos.last_fusions(jitted)]
    assert graphs and not any(n.target is torch.ops.aten.clone.default
                              for g in graphs for n in g.nodes)
    assert any(n.target is torch.cat for g in graphs for n in g.nodes)


@pytest.mark.parametrize("layout", ["permuted", "channels_last"])
def test_a_cat_of_one_non_empty_tensor_returns_eagers_strides(layout):
    def f(x, empty):
        return torch.cat((empty, x * 2, empty), dim=1) + 1, torch.cat((x.exp(), empty), dim=1)

    x = torch.randn(2, 3, 4, 5)
    x = x.permute(0, 2, 3, 1) if layout == "permuted" else x.contiguous(
        memory_format=torch.channels_last)
    empty = torch.randn(x.shape[0], 0, *x.shape[2:])
    out, ref = keraunos.jit(f, executors=FUSED, fuse="wait")(x, empty), f(x, empty)
    for a, b in zip(out, ref):
        assert_close(a, b, **TOL)
        assert a.stride() == b.stride()


def test_random_ops_give_eager_values_and_leave_the_stream_where_eager_does():
    def f(x):
        y = torch.sigmoid(x * 2) + 1
        z = F.dropout(y, p=0.5, training=True) * y
        return torch.tanh(z + torch.rand_like(z))

    x = torch.randn(8, 8)
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    for seed in (0, 1):
        torch.manual_seed(seed)
        out = jitted(x)
        after = torch.rand(3)
        torch.manual_seed(seed)
        ref = f(x)
        assert_close(out, ref, **TOL)
        assert_close(after, torch.rand(3))
    trace = keraunos.last_traces(jitted)[-1]
    random_lines = [b for b in trace.bound_symbols if "dropout" in b.symbol.name
                    or "rand" in b.symbol.name]
    assert random_lines and all(b.executor == "torch" for b in random_lines)


def test_attention_with_dropout_fuses_all_but_the_draws():
    """Training-mode attention with ``dropout_p`` runs as its ATen ops (the backward needs its
    mask): only ``bernoulli_`` draws, so only it stays out of regions; the scaling, softmax and
    matmuls around it fuse (they used to inherit the random tag and ran op by op on torch). The
    loss, every gradient and the generator's state afterwards are eager's."""
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.out = nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
            return F.dropout(self.out(a.transpose(1, 2).reshape(2, 6, 16)), 0.2).sum()

    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    for seed in (0, 1):
        x = torch.randn(2, 6, 16)
        model.zero_grad(), reference.zero_grad()
        torch.manual_seed(seed)
        loss = jitted(x)
        loss.backward()
        after = torch.rand(3)
        torch.manual_seed(seed)
        expected = reference(x)
        expected.backward()
        assert_close(loss, expected, **TOL)
        assert_close(after, torch.rand(3))
        assert_grads_match(model, reference, **TOL)
    trace = keraunos.last_traces(jitted)[-1]
    outside = [b.symbol.name for b in trace.bound_symbols if b.executor == "torch"]
    inside = " ".join(b.symbol.name for line in fusion_lines(trace) for b in line.subsymbols)
    assert any("bernoulli_" in name for name in outside)
    assert not any(op in name for name in outside for op in ("softmax", "bmm", "matmul"))
    assert "softmax" in inside and "bernoulli" not in inside


class _StochasticDepthBlock(nn.Module):
    """torchvision's ``StochasticDepth`` in "row" mode after a block's body, then the residual:
    ``noise = torch.empty(...).bernoulli_(p).div_(p)``, ``out * noise``, ``+= input``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        out = F.silu(self.bn(self.conv(x)))
        noise = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype, device=x.device)
        noise.bernoulli_(0.8)
        noise.div_(0.8)
        out = out * noise
        out += x
        return out


def test_a_random_draw_into_fresh_memory_runs_before_the_region_and_the_block_fuses_whole():
    """Stochastic depth draws its mask between a block's body and the scaling that uses it: the
    draw (into a ``torch.empty`` the block's lines never touch) runs before the block's region,
    so the scaling, the product and the residual join the region instead of running on torch
    with their backward. Values, gradients, running statistics and the generator's state after
    the call are eager's, for two seeds."""
    torch.manual_seed(0)
    model = nn.Sequential(_StochasticDepthBlock(), _StochasticDepthBlock()).train()
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    for seed in (0, 1):
        x = torch.randn(2, 4, 6, 6)
        model.zero_grad(), reference.zero_grad()
        torch.manual_seed(seed)
        out = jitted(x)
        after = torch.rand(3)
        torch.manual_seed(seed)
        expected = reference(x)
        assert_close(out, expected, **TOL)
        assert_close(after, torch.rand(3))
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_grads_match(model, reference, **TOL)
        for got, want in zip(model.buffers(), reference.buffers()):
            assert_close(got, want, **TOL)
    trace = keraunos.last_traces(jitted)[-1]
    outside = [b.symbol.name for b in trace.bound_symbols if b.executor == "torch"]
    inside = " ".join(b.symbol.name for line in fusion_lines(trace) for b in line.subsymbols)
    assert sum("bernoulli_" in name for name in outside) == 2
    assert not any(op in name for name in outside for op in ("div_", "mul", "add_", "silu"))
    assert "div_" in inside and "bernoulli" not in inside


class _ConvNormActivation(nn.Sequential):
    """torchvision's ``Conv2dNormActivation``: a layer whose last lines are its batch norm's."""

    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.SiLU(inplace=True))


def test_a_layer_ending_in_a_lowered_batch_norm_is_one_region_in_training():
    """In training the forward runs batch norm and the in-place SiLU as their ATen calls; those
    calls are the layer's lines, so each ``conv, norm, activation`` layer is one region (the
    convolution and the ``num_batches_tracked += 1`` used to run on torch before a region of
    the norm, since no line of the layer followed the ATen calls). Values, gradients and the
    running statistics are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(_ConvNormActivation(8, 8), _ConvNormActivation(8, 8)).train()
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    for _ in range(2):
        x = torch.randn(2, 8, 6, 6)  # (alike layers: regions are cut only between those)
        model.zero_grad(), reference.zero_grad()
        out, expected = jitted(x), reference(x)
        assert_close(out, expected, **TOL)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_grads_match(model, reference, **TOL)
        for got, want in zip(model.buffers(), reference.buffers()):
            assert_close(got, want, **TOL)
    trace = keraunos.last_traces(jitted)[-1]
    assert len(fusion_lines(trace)) == 2
    assert not [b.symbol.name for b in trace.bound_symbols
                if b.executor == "torch" and ("conv" in b.symbol.name or "add_" in b.symbol.name)]


def test_a_random_draw_into_memory_the_region_reads_stays_where_it_is():
    """A draw that overwrites what the lines before it read (``h = x * 2`` reads ``x``, then
    ``x.bernoulli_(0.5)``) does not move above them: ``h`` is eager's, and so is ``x``."""
    def f(x):
        h = torch.sigmoid(x * 2) + 1
        x.bernoulli_(0.5)
        return (h * x).sum(-1) + h.mean()

    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    for seed in (0, 1):
        x, x_ref = torch.rand(4, 8), None
        x_ref = x.clone()
        torch.manual_seed(seed)
        out = jitted(x)
        torch.manual_seed(seed)
        assert_close(out, f(x_ref), **TOL)
        assert_close(x, x_ref)


def test_in_place_add_to_scores_requiring_grad_fuses_in_the_forward():
    """T5's ``scores += position_bias`` on a tensor that requires grad: in the forward trace of
    keraunos's autograd split nothing records autograd, so the write joins the region with the
    softmax after it (it used to run on torch, with the softmax); gradients are eager's."""
    class Scores(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)
            self.bias = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            q = self.q(x)
            scores = q @ x.transpose(-1, -2)
            scores += self.bias
            return (scores.softmax(-1) @ q).square().sum()

    torch.manual_seed(0)
    jitted = check_grads(Scores(), torch.randn(2, 4, 8), executors=FUSED, fuse="wait", **TOL)
    trace = keraunos.last_traces(jitted)[-1]
    inside = " ".join(b.symbol.name for line in fusion_lines(trace) for b in line.subsymbols)
    assert "add_" in inside and "softmax" in inside
    assert not any("add_" in b.symbol.name for b in trace.bound_symbols if b.executor == "torch")


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(compiler, "toolchain_problem", lambda device: "no C++ compiler found")
    monkeypatch.setattr(compiler, "_warned", set())

    def f(x):
        return torch.tanh(x * 2).exp() + 1

    x = torch.randn(4)
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    with pytest.warns(UserWarning, match="cannot build cpu kernels here .*no C\\+\\+ compiler"):
        assert_close(jitted(x), f(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per compilation
        keraunos.jit(f, executors=FUSED, fuse="wait")(x)
    trace = keraunos.last_traces(jitted)[-1]
    assert not fusion_lines(trace) and "torch" in executors_of(trace)
    assert keraunos.last_fusions(jitted) == []


def test_thread_count_is_part_of_the_region_key():
    def f(x):
        return torch.cos(x * 5).exp() - 1

    x = torch.randn(16)
    threads = torch.get_num_threads()
    kernels = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
            assert_close(jitted(x), f(x), **TOL)
            kernels.append(keraunos.last_fusions(jitted)[0].kernel)
    finally:
        torch.set_num_threads(threads)
    assert kernels[0] is not kernels[1]


def test_default_executors_do_not_fuse():
    def f(x):
        return torch.tanh(x * 2).exp() + 1

    jitted = keraunos.jit(f)
    jitted(torch.randn(4))
    assert not fusion_lines(keraunos.last_traces(jitted)[-1])
    assert keraunos.last_fusions(jitted) == []


# ----------------------------------------------------------------------------- litgpt training
LITGPT_FAMILIES = {  # real litgpt configs shrunk to 2 layers, as in test_litgpt_training.py
    "llama2": ("Llama-2-7b-hf", dict(n_head=4, n_query_groups=4, head_size=16,
                                     intermediate_size=176)),
    "falcon": ("falcon-7b", dict(n_head=4, n_query_groups=1, head_size=16,
                                 intermediate_size=256)),
    "mixtral": ("Mixtral-8x7B-v0.1", dict(n_head=4, n_query_groups=2, head_size=16,
                                          intermediate_size=96)),
}

# Each family compiles 6-8 distinct regions (15-30 s cold here): CI runs llama2;
# KERAUNOS_FUSION_FAMILIES=all (or a comma-separated list) runs the others too.
_WANTED = os.environ.get("KERAUNOS_FUSION_FAMILIES", "llama2")
FAMILIES_RUN = sorted(LITGPT_FAMILIES) if _WANTED == "all" else _WANTED.split(",")


def _litgpt_model(family: str, n_layer: int):
    """A tiny litgpt model of ``family`` (random weights, seed 0)."""
    litgpt = pytest.importorskip("litgpt")
    from litgpt.model import GPT as LitGPT
    name, overrides = LITGPT_FAMILIES[family]
    config = litgpt.Config.from_name(name, n_layer=n_layer, n_embd=64, vocab_size=256,
                                     padded_vocab_size=256, block_size=64, **overrides)
    torch.manual_seed(0)
    return LitGPT(config)


@pytest.mark.parametrize("family", FAMILIES_RUN)
def test_litgpt_adamw_losses_and_gradients_match_eager(family):
    model = _litgpt_model(family, n_layer=2)
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    idx, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    for step in range(10):
        losses, grads = [], []
        for m, run, optimizer in ((model, jitted, optimizers[0]),
                                  (reference, reference, optimizers[1])):
            optimizer.zero_grad()
            loss = F.cross_entropy(run(idx).view(-1, 256), targets.view(-1))
            loss.backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            optimizer.step()
            losses.append(loss.detach())
        assert_close(losses[0], losses[1], **TOL, msg=f"step {step}")
        if step == 0:
            for (pname, _), g, r in zip(model.named_parameters(), *grads):
                assert_close(g, r, **TOL, msg=pname)
    for trace_name in ("computation", "backward"):
        kernels = {}
        for r in keraunos.last_fusions(jitted):
            if r.trace_name == trace_name and r.layer is not None:
                kernels.setdefault(r.layer, set()).add(r.kernel.number)
        # The second layer compiles nothing of its own (the first can have more: values both
        # layers use, a mask say, are computed once, in the first).
        first, second = kernels.values()
        assert second <= first, kernels


@pytest.mark.parametrize("family", ["llama2", "mixtral"])
def test_litgpt_backward_layers_make_identical_regions_with_none_between(family, monkeypatch):
    # The gradient of a layer's input is summed after the layer's own lines, and the layer
    # below reads views of it: those lines join the layers, so every layer's backward region
    # is the same graph (one kernel) and no few-line region between layers needs one of its own.
    # The regions are formed and recorded here, not compiled.
    from keraunos.executors.fusion import fx_graph
    model = _litgpt_model(family, n_layer=4)
    formed = []

    def record(region, prepared, trace_name, *args):
        graph = fx_graph.region_graph(region.lines, region.inputs, region.outputs)
        formed.append((trace_name, region.layer, graph.python_code(root_module="self").src))
        return None  # the lines run on the torch executor
    monkeypatch.setattr(fusion, "_fuse_region", record)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    idx = torch.randint(0, 256, (2, 16))
    jitted(idx).sum().backward()
    backward = [(layer, code) for trace_name, layer, code in formed if trace_name == "backward"]
    layers = [layer for layer, _ in backward]
    tagged = [i for i, layer in enumerate(layers) if layer is not None]
    assert [layers[i] for i in tagged] == [f"transformer.h.{k}" for k in (3, 2, 1, 0)]
    assert all(layers[i] is not None for i in range(tagged[0], tagged[-1] + 1)), layers
    assert len({backward[i][1] for i in tagged}) == 1


def saved_for_backward(fn, parameters):
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` builds its
    graph: all of them, and those that are not parameters (the activations); and ``fn()``."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    params = {p.untyped_storage().data_ptr() for p in parameters}
    activations = sum(n for ptr, n in storages.items() if ptr not in params)
    return sum(storages.values()), activations, result


def test_litgpt_fused_training_saves_no_more_than_eager():
    # The llama2 config of the AdamW test above: its kernels are already in this process.
    model = _litgpt_model("llama2", n_layer=2)
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    idx = torch.randint(0, 256, (2, 16))
    jitted(idx)  # compile outside the measurement
    got, got_activations, out = saved_for_backward(lambda: jitted(idx), model.parameters())
    want, want_activations, ref = saved_for_backward(lambda: reference(idx),
                                                     reference.parameters())
    assert got_activations > 0
    assert got <= want, f"keraunos+inductor saves {got} bytes for backward, eager {want}"
    assert got_activations <= want_activations, (got_activations, want_activations)
    assert fusion_lines(keraunos.last_traces(jitted)[-1])
    assert fusion_lines(keraunos.last_backward_traces(jitted)[-1])
    assert_close(out, ref, **TOL)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    assert_grads_match(model, reference, **TOL)


def test_a_region_inductor_cannot_compile_runs_on_torch_with_a_warning(monkeypatch):
    def refuse(*args):
        raise RuntimeError("lowering failed")
    monkeypatch.setattr(compiler, "_compile", refuse)
    monkeypatch.setattr(compiler, "_kernels", {})
    monkeypatch.setattr(compiler.kernel_store, "load", lambda key: None)  # compiled, not loaded
    monkeypatch.setattr(compiler, "_warned", set())

    def f(x):
        return torch.sin(x * 3).exp() + 2

    x = torch.randn(5)
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    with pytest.warns(UserWarning, match="Inductor could not compile .*lowering failed"):
        assert_close(jitted(x), f(x))
    assert not fusion_lines(keraunos.last_traces(jitted)[-1])


def test_kernels_g_plus_plus_fails_to_build_run_the_region_lines_with_a_warning(monkeypatch):
    # g++ builds a region's kernels while the rest compiles; its failure shows at the first
    # call, which then runs the region's own lines (the torch executor's ops), exactly.
    compile_region = compiler._compile

    def failing_build(*args):
        kernel = compile_region(*args)
        kernel.pending.insert(0, (lambda scope: (_ for _ in ()).throw(
            RuntimeError("g++ failed")), {}))
        return kernel
    monkeypatch.setattr(compiler, "_compile", failing_build)
    monkeypatch.setattr(compiler, "_kernels", {})
    monkeypatch.setattr(compiler.kernel_store, "load", lambda key: None)
    monkeypatch.setattr(compiler, "_warned", set())

    def f(x):
        return torch.cos(x * 5).exp() - 1

    x = torch.randn(6)
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    with pytest.warns(UserWarning, match="could not build the kernels .*g\\+\\+ failed"):
        assert_close(jitted(x), f(x), rtol=0, atol=0)  # the torch executor's ops: exact
    assert len(fusion_lines(keraunos.last_traces(jitted)[-1])) == 1
    assert_close(jitted(x), f(x), rtol=0, atol=0)


def test_only_the_compiling_thread_puts_off_inductors_waits():
    # While keraunos compiles a region on one thread, Inductor's wait for C++ kernels is
    # recorded for later there; a torch.compile on another thread meanwhile waits as usual.
    from concurrent.futures import Future
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    def scope():
        built = Future()
        built.set_result("kernel")
        return {"cpp_fused_0": built}
    ours, theirs = scope(), scope()
    with config.patch(compile_threads=2), patches.applied(), \
            collecting.from_inductor() as (_, pending):
        AsyncCompile().wait(ours)  # (Inductor waits for futures only with a pool of threads)
        other = threading.Thread(target=AsyncCompile().wait, args=(theirs,))
        other.start()
        other.join()
    assert theirs == {"cpp_fused_0": "kernel"}
    assert isinstance(ours["cpp_fused_0"], Future) and len(pending) == 1
    wait, waited_scope = pending[0]
    with config.patch(compile_threads=2):
        wait(waited_scope)
    assert ours == {"cpp_fused_0": "kernel"}


def test_dynamo_front_end_fuses_too():
    def f(x, y):
        return torch.tanh(x @ y).exp() * 2 - 1

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    backend = keraunos.dynamo.backend(executors=FUSED, fuse="wait")
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    assert_close(compiled(x, y), f(x, y), **TOL)
    (subgraph,) = backend.subgraphs
    assert fusion_lines(keraunos.last_traces(subgraph.jitted)[-1])


def test_dynamo_route_recompiles_for_a_parameter_whose_layout_changed():
    """Region kernels bake their inputs' strides in and no longer check them (``size_asserts``
    off); on the backend route dynamo's guards cover the parameters (inlined modules' tensors
    are graph inputs with tensor guards): ``w.data = w.data.t().contiguous().t()`` makes dynamo
    compile again, and the values stay eager's, never a kernel reading the new layout as the
    old."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    backend = keraunos.dynamo.backend(executors=FUSED, fuse="wait")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert_close(compiled(x), model(x), **TOL)
        weight = model[0].weight
        weight.data = weight.data.t().contiguous().t()  # same values, other strides
        assert weight.stride() == (1, 8)
        assert_close(compiled(x), model(x), **TOL)
    assert len(backend.subgraphs) == 2
    torch._dynamo.reset()


def test_a_tensor_made_to_require_grad_inside_stays_a_leaf_of_autograd():
    def f(x):
        w = torch.ones(4, requires_grad=True)
        return (torch.tanh(x * 2) * w).exp() + 1, w

    x = torch.randn(4)
    (out, w), (ref, ref_w) = keraunos.jit(f, executors=FUSED, fuse="wait")(x), f(x)
    assert_close(out, ref, **TOL)
    assert w.requires_grad and w.is_leaf and out.requires_grad == ref.requires_grad
    out.sum().backward()
    ref.sum().backward()
    assert_close(w.grad, ref_w.grad, **TOL)


def test_rounding_to_bfloat16_inside_a_region_rounds_as_in_eager():
    def f(x):
        return ((x * 3).exp().to(torch.bfloat16).float() * 2 + 1).sum(0)

    x = torch.randn(64, 8)
    assert_close(keraunos.jit(f, executors=FUSED, fuse="wait")(x), f(x), **TOL)


# ----------------------------------------------------------------------------- OpInfo with fusion
# 30 ops of PyTorch's OpInfo database, the first sample of each, each op alone a region compiled
# by Inductor (benchmarks/coverage.py --executors inductor,torch runs them all); values at
# opinfo.FUSED's tolerance (docs/coverage.md, "With fusion"). A fixed list, so CI is deterministic;
# a test per op and kind, so that the run spreads their compiles over its workers.
OPINFO_FORWARD = ("exp", "sin", "tanh", "sigmoid", "erf", "log1p", "rsqrt", "abs", "reciprocal",
                  "add", "mul", "div.no_rounding_mode", "pow", "maximum", "where", "clamp", "lerp",
                  "sum", "mean", "amax", "var", "softmax", "log_softmax", "logsumexp", "cumsum",
                  "mm", "addmm", "nn.functional.layer_norm", "nn.functional.gelu", "cat")
OPINFO_BACKWARD = ("tanh", "softmax", "addmm", "nn.functional.layer_norm")


@pytest.mark.parametrize("name, kind", [(name, "forward") for name in OPINFO_FORWARD] + [
    (name, "backward") for name in OPINFO_BACKWARD], ids=lambda v: v)
def test_an_opinfo_op_alone_in_a_fused_region_matches_eager(monkeypatch, name, kind):
    from keraunos.executors.fusion.regions import fusing_single_ops
    from keraunos.testing.opinfo import check_op, op_database, op_name
    op, = [op for op in op_database() if op_name(op) == name]
    compiled = []  # one entry per region handed to Inductor: a Kernel, or the failure
    kernel_for = compiler.kernel_for

    def recording(*args, **kwargs):
        found = kernel_for(*args, **kwargs)
        compiled.append(found[0])
        return found
    monkeypatch.setattr(compiler, "kernel_for", recording)
    with fusing_single_ops():
        result = check_op(op, kind, max_samples=1, executors=FUSED)
    assert result.status == "passed", result.message
    assert compiled, "no region was handed to Inductor"
    assert all(isinstance(k, compiler.Kernel) for k in compiled), [
        k.error for k in compiled if not isinstance(k, compiler.Kernel)]


def test_fusing_single_ops_in_one_thread_leaves_other_threads_alone():
    from keraunos.executors.fusion.regions import fusing_single_ops
    inside, release = threading.Event(), threading.Event()

    def sweep():  # an OpInfo sweep with fusion, in another thread
        with fusing_single_ops():
            inside.set()
            release.wait(60)
    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    try:
        assert inside.wait(60)
        jitted = keraunos.jit(lambda x: torch.sin(x), executors=FUSED, fuse="wait")
        x = torch.randn(4)
        assert_close(jitted(x), torch.sin(x), rtol=0, atol=0)
        assert not fusion_lines(keraunos.last_traces(jitted)[-1])  # one op: not worth a compile
    finally:
        release.set()
        sweeper.join()


# ----------------------------------------------------------------------------- symbolic sizes
def symbolic_fusion(jitted):
    """The entry's fusion lines and regions, and whether its trace has symbolic sizes."""
    trace = keraunos.last_traces(jitted)[-1]
    return fusion_lines(trace), keraunos.last_fusions(jitted), "s0" in str(trace)


def test_symbolic_entry_is_fused_once_for_every_size():
    def f(x, w):
        y = torch.tanh(x @ w) * 2
        return (y.view(x.shape[0], -1, 4).softmax(-1) + 1).sum(1)

    jitted = keraunos.jit(f, cache="symbolic values", executors=FUSED, fuse="wait")
    w = torch.randn(8, 8)
    kernels = set()
    with torch.no_grad():
        for n in (6, 7, 12, 3):
            x = torch.randn(n, 8)
            out, ref = jitted(x, w), f(x, w)
            assert_close(out, ref, **TOL)
            assert out.shape == ref.shape and out.stride() == ref.stride()
            lines, regions, symbolic = symbolic_fusion(jitted)
            assert symbolic and len(lines) == 1 and len(regions) == 1
            kernels.add(regions[0].kernel.number)
    assert keraunos.cache_misses(jitted) == 1 and len(kernels) == 1
    assert "view(i2, -1, 4)" in regions[0].graph.code  # the size symbol is a graph input


def test_symbolic_training_fuses_forward_and_backward_layers_once():
    torch.manual_seed(0)
    model = Stack(3)
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait", cache="symbolic values")
    # Incoming gradients of strides 1, 2 and 0: checked against the traced layout, evaluated
    # for each call's sizes.
    for n, grad in ((3, torch.randn(3)), (5, torch.randn(10)[::2]), (9, torch.randn(1).expand(9))):
        x1 = torch.randn(n, 16, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        model.zero_grad()
        reference.zero_grad()
        out, ref = jitted(x1), reference(x2)
        assert_close(out, ref, **TOL)
        out.backward(grad)
        ref.backward(grad)
        assert_close(x1.grad, x2.grad, **TOL)
        assert_grads_match(model, reference, **TOL)
    assert keraunos.cache_misses(jitted) == 1
    assert "s0" in str(keraunos.last_backward_traces(jitted)[-1])
    for trace_name in ("computation", "backward"):
        layers = [r for r in keraunos.last_fusions(jitted)
                  if r.trace_name == trace_name and r.layer is not None]
        assert len(layers) == 3 and len({r.kernel.number for r in layers}) == 1, trace_name


def test_automatic_dynamic_entry_is_fused():
    def f(x):
        return torch.sigmoid(x * 3).cumsum(0) - x.mean(0)

    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    for n in (4, 6, 9, 13):
        x = torch.randn(n, 5)
        assert_close(jitted(x), f(x), **TOL)
    assert keraunos.cache_misses(jitted) == 2  # 4 exact; 6 recompiled with dim 0 symbolic
    lines, regions, symbolic = symbolic_fusion(jitted)
    assert symbolic and lines and len({r.kernel.number for r in regions}) == len(regions)


def test_sizes_the_kernel_was_not_compiled_for_run_the_region_lines(monkeypatch):
    # A fact Inductor assumed while compiling (here one added for the test: s0 <= 8) is
    # checked on every call; a call outside it runs the region's own lines, exactly.
    import sympy
    from keraunos.executors.fusion import symbolic
    added = symbolic.added_facts

    def with_s0_at_most_8(shape_env):
        s0 = next(s for s, name in shape_env.keraunos_names.items() if name == "s0")
        return added(shape_env) + [sympy.Le(s0, 8)]
    monkeypatch.setattr(symbolic, "added_facts", with_s0_at_most_8)

    def f(x):
        return (torch.cos(x) * 4).exp().sum(-1)

    jitted = keraunos.jit(f, cache="symbolic values", executors=FUSED, fuse="wait")
    x = torch.randn(5, 3)
    assert_close(jitted(x), f(x), **TOL)
    (line,) = fusion_lines(keraunos.last_traces(jitted)[-1])
    (where,) = [t for t in str(keraunos.last_traces(jitted)[-1]).splitlines()
                if t.startswith("  #   kernel where ")]
    conditions = where.removeprefix("  #   kernel where ").removesuffix("; else these lines:")
    assert "s0 <= 8" in conditions.split(" and ")
    ran = []
    kernel_fn, fallback = line.symbol.call.kernel.fn, line.symbol.call.fallback
    monkeypatch.setattr(line.symbol.call, "run", lambda *a: ran.append("kernel") or kernel_fn(*a))
    monkeypatch.setattr(line.symbol.call, "fallback",
                        lambda *a: ran.append("lines") or fallback(*a))
    for n in (7, 8, 9, 20):
        x = torch.randn(n, 3)
        assert_close(jitted(x), f(x), **TOL)
    assert ran == ["kernel", "kernel", "lines", "lines"]
    assert keraunos.cache_misses(jitted) == 1


def test_a_size_inductor_assumed_is_the_kernels_guard_not_the_entrys(monkeypatch):
    # Inductor compiles the reduction assuming its size is at most 4096 and records that in the
    # ShapeEnv it is given: a private copy, so the fact guards the kernel, not the entry (whose
    # prologue checks the capture's ShapeEnv); a larger size runs the region's own lines on the
    # same entry instead of recompiling.
    def f(x):
        return (x.exp() * 2).sum(0)

    jitted = keraunos.jit(f, cache="symbolic values", executors=FUSED, fuse="wait")
    x = torch.randn(64, 8)
    assert_close(jitted(x), f(x), **TOL)
    (line,) = fusion_lines(keraunos.last_traces(jitted)[-1])
    assert "s0 <= 4096" in line.symbol.call.guard_source
    assert "4096" not in str(keraunos.last_prologue_traces(jitted)[-1])
    ran, fallback = [], line.symbol.call.fallback
    monkeypatch.setattr(line.symbol.call, "fallback",
                        lambda *a: ran.append("lines") or fallback(*a))
    big = torch.randn(5000, 8)
    assert_close(jitted(big), f(big), **TOL)
    assert ran == ["lines"]
    assert keraunos.cache_misses(jitted) == 1


# ----------------------------------------------------------------------------- keraunos bench
def test_bench_quick_runs_and_reports_every_figure(tmp_path, capsys):
    from keraunos import cli
    figures = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--workloads", "a", "--systems", "eager,keraunos",
                     "--chart", "", "--json", str(figures)]) == 0
    printed = capsys.readouterr().out
    assert "(a) Llama-3-8B-shaped" in printed and "keraunos " in printed
    import json
    rows = json.loads(figures.read_text())
    assert [(r["workload"], r["system"]) for r in rows] == [("a", "eager"), ("a", "keraunos")]
    eager, jitted = rows
    assert eager["warm"] is None and jitted["warm"] is not None  # a second process, warm
    for r in (eager["cold"], jitted["cold"], jitted["warm"]):
        assert r["median"] > 0 and r["peak"] > 0 and r["diff"] < 1e-4, r


def test_bench_chart_needs_matplotlib_and_says_so(tmp_path, capsys):
    bench = __import__("keraunos.cli", fromlist=["_bench_script"])._bench_script()
    run = dict(compile=1.0, median=0.01, first=1.0, peak=2**20, peak_over_setup=0, saved=None,
               diff=0.0)
    rows = [dict(workload="a", system=s, cold=dict(run, median=m), warm=None)
            for s, m in (("eager", 0.02), ("keraunos+inductor", 0.01), ("torch.compile", 0.005))]
    text = bench.table(rows)
    assert "0.50x" in text and "2.00x" in text  # keraunos+inductor vs eager, vs torch.compile
    path = tmp_path / "chart.png"
    try:
        import matplotlib  # noqa: F401 - the bench extra
    except ImportError:
        assert bench.chart(rows, str(path)) is False and not path.exists()
        assert "pip install 'keraunos[bench]'" in capsys.readouterr().err
    else:
        assert bench.chart(rows, str(path)) is True
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grad_mode_switched_inside_the_program_fuses_around_what_autograd_records():
    def f(x, w):
        a = torch.sigmoid(x * 2) + 1  # no grad mode: fused
        with torch.enable_grad():
            y = torch.tanh(a @ w) * 2  # reads w, which requires grad: autograd records it
        return y, (a * 3).exp()

    x, w = torch.randn(4, 6), torch.randn(6, 3, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    with torch.no_grad():
        (y, b), (ref_y, ref_b) = jitted(x, w), f(x, w2)
    assert_close(y, ref_y, **TOL)
    assert_close(b, ref_b, **TOL)
    assert y.requires_grad and ref_y.requires_grad and not b.requires_grad
    grad = torch.randn(4, 3)
    y.backward(grad)
    ref_y.backward(grad)
    assert_close(w.grad, w2.grad, **TOL)
    trace = keraunos.last_traces(jitted)[-1]
    assert fusion_lines(trace)
    recorded = [b for b in trace.bound_symbols if b.symbol.name in ("matmul", "tanh", "mul")
                and any(p.requires_grad for p in b.output_proxies())]
    assert recorded and all(b.executor == "torch" for b in recorded)


def test_litgpt_over_prompt_lengths_fuses_the_dynamic_entry_with_one_kernel_per_layer():
    model = _litgpt_model("llama2", n_layer=2).eval()
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    with torch.no_grad():
        for length in (8, 12, 16, 23, 5):
            idx = torch.randint(0, 256, (1, length))
            assert_close(jitted(idx), model(idx), **TOL)
    assert keraunos.cache_misses(jitted) == 2  # 8 exact, then one symbolic entry for the rest
    lines, regions, symbolic = symbolic_fusion(jitted)
    layers = [r for r in regions if r.layer is not None]
    assert symbolic and lines and [r.layer for r in layers] == ["transformer.h.0",
                                                                "transformer.h.1"]
    assert layers[0].kernel is layers[1].kernel


def test_litgpt_generate_fuses_each_decode_layer_with_its_cache_writes():
    """litgpt's ``generate()`` with a KV cache: a decode step's layer, with the cache writes
    (``index_copy_``) and the symbolic slices of the cache (``k[..., :input_pos_maxp1, :]``),
    is one region, and both layers share its kernel; the tokens and caches are eager's."""
    from litgpt.generate.base import generate
    model = _litgpt_model("llama2", n_layer=2).eval()
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    for length in (7, 11):
        prompt = torch.randint(0, 256, (length,))
        runs = []
        for m, run in ((model, jitted), (reference, reference)):
            m.max_seq_length = 64
            m.set_kv_cache(batch_size=1)
            runs.append(generate(run, prompt, length + 8, temperature=0.0, top_k=1))
        assert torch.equal(runs[0], runs[1])
        for a, b in zip(model.buffers(), reference.buffers()):
            assert_close(a, b, **TOL)
    layers = [r for r in keraunos.last_fusions(jitted) if r.layer is not None]
    assert [r.layer for r in layers] == ["transformer.h.0", "transformer.h.1"]
    assert layers[0].kernel is layers[1].kernel
    for r in layers:
        names = [b.symbol.name for b in r.lines]
        assert names.count("index_copy_") == 2 and len(r.written) == 2
    assert keraunos.cache_misses(jitted) <= 4  # prefill and decode, exact then symbolic


class _Residual(nn.Module):
    def __init__(self, n=3, width=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))
                                    for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x.sum(-1)


def test_backward_region_reading_an_expanded_gradient_gets_its_values():
    """`out.sum().backward()` hands in a gradient expanded along every dim (strides 0, 0); the
    backward region was compiled for `expand(unsqueeze(grad))`, strides (1, 0). Making that
    layout from the call's tensor used to fail ("more than one element of the written-to
    tensor refers to a single memory location")."""
    model = _Residual()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    jitted = keraunos.jit(model, executors=FUSED, fuse="wait")
    for _ in range(2):  # the first call fixes layouts, the second runs the fixing path
        jitted(x).sum().backward()
        ref(xe).sum().backward()
    assert_close(x.grad, xe.grad, **TOL)
    assert_grads_match(model, ref, **TOL)
    assert keraunos.last_fusions(jitted)


def test_symbolic_region_with_a_zero_dim_output_matches_eager():
    """A region of a symbolic entry whose output has no sizes at all (a sum): its layout was
    evaluated by ``lambda v0: (,)``, a SyntaxError on the second size (fuzzer with fusion,
    90:19)."""
    def f(x):
        a = (x * 2).sin()
        return a.sum() * 3, a.cos() + 1
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    for n in (3, 4, 5, 6):
        x = torch.randn(n, 4)
        assert_close(jitted(x), f(x), **TOL)
    assert keraunos.cache_misses(jitted) == 2  # 3, then symbolic for every later size
    assert fusion_lines(keraunos.last_traces(jitted)[-1])


def test_writes_in_regions_keep_eagers_order_and_sharing():
    """In-place writes inside regions: a line the executor does not fuse (complex) reads the
    written memory after the write and must not move above it; a view of the written input
    passed as a second argument shares its memory, so that write stays out of the region (the
    region's graph would see two inputs with memory of their own); the values, the inputs'
    contents and their version counts are eager's on every call."""
    def f(cache, x):
        a = x * 2
        cache.add_(a)
        c = cache.to(torch.complex64)
        return (a.sin() * 3 + c.real).tanh(), c

    def g(cache, row, x):
        cache.mul_(x.sigmoid())
        return (row * 2).tanh() + x.cos()
    for fn, make in ((f, lambda: (torch.randn(4, 4), torch.randn(4, 4))),
                     (g, lambda: (lambda c: (c, c[0], torch.randn(4)))(torch.randn(4, 4)))):
        jitted = keraunos.jit(fn, executors=FUSED, fuse="wait")
        for _ in range(3):
            args = make()
            twins = [a.clone() for a in args]
            if fn is g:
                twins[1] = twins[0][0]
            before = [a._version for a in args], [t._version for t in twins]
            assert_close(jitted(*args), fn(*twins), **TOL)
            for a, t in zip(args, twins):
                assert_close(a, t, **TOL)
            assert [a._version - v for a, v in zip(args, before[0])] == \
                [t._version - v for t, v in zip(twins, before[1])]
        assert fusion_lines(keraunos.last_traces(jitted)[-1])


def test_a_tensor_made_written_and_handed_out_by_a_region_stays_inside():
    """Mixtral's router: ``v, i = topk(logits)``, then ``v /= v.sum(-1)``, and the experts read
    ``v`` after the region. The region makes ``v``, writes it and hands it out with the written
    values: the write joins the region (it used to cut the layer in three). Two outputs of the
    written memory (``v`` and a view of it made before the write, both read after the region)
    would come back as tensors of their own, so that write stays out."""
    def router(x, w):
        v, i = torch.topk((x @ w).softmax(-1), 2, dim=-1)
        v.div_(v.sum(-1, keepdim=True))
        return v, i

    def with_view(x, w):
        v, _ = torch.topk((x @ w).softmax(-1), 2, dim=-1)
        first = v[:, 0]
        v.div_(v.sum(-1, keepdim=True))
        # complex: not fused, so that ``v`` and ``first`` both leave the region
        return v.to(torch.complex64).real * 2, first.to(torch.complex64).real + 1

    w = torch.randn(8, 4)
    for fn, inside in ((router, True), (with_view, False)):
        jitted = keraunos.jit(fn, executors=FUSED, fuse="wait")
        for _ in range(2):
            x = torch.randn(6, 8)
            with torch.no_grad():
                assert_close(jitted(x, w), fn(x, w), **TOL)
        fused = [b.symbol.name for line in fusion_lines(keraunos.last_traces(jitted)[-1])
                 for b in line.subsymbols]
        assert ("div_" in " ".join(fused)) is inside, fn.__name__


class _InPlaceActivations(nn.Module):
    """torchvision's blocks: conv, batch norm, then activations applied in place."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.silu, self.hardswish = nn.SiLU(inplace=True), nn.Hardswish(inplace=True)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.silu(self.bn(self.conv(x)))
        return self.relu(self.hardswish(h * 2 + 1)) - 1


def test_in_place_activations_fuse_with_their_neighbours():
    torch.manual_seed(0)
    model = _InPlaceActivations()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    jitted = keraunos.jit(model.eval(), fuse="wait")
    with torch.no_grad():
        assert_close(jitted(x), eager.eval()(x), **TOL)
    trace = str(keraunos.last_traces(jitted)[-1])
    body = [line for line in trace.splitlines() if not line.lstrip().startswith("#")]
    assert len(keraunos.last_fusions(jitted)) == 1  # two writes of one memory, in one region
    assert not any("inplace=True" in line for line in body)
    # Training: batch norm's running statistics written in place, the gradients through them.
    jitted = keraunos.jit(model.train(), fuse="wait")
    out, want = jitted(x), eager.train()(x)
    assert_close(out, want, **TOL)
    out.square().sum().backward()
    want.square().sum().backward()
    assert_grads_match(model, eager, **TOL)
    assert_close(model.bn.running_mean, eager.bn.running_mean, **TOL)
    assert_close(model.bn.running_var, eager.bn.running_var, **TOL)


def test_in_place_activation_of_an_input_or_of_a_viewed_tensor_writes_what_eager_writes():
    def of_input(x):
        y = x * 3  # x's memory is the caller's: written in place, and seen by the caller
        F.relu(x, inplace=True)
        F.hardtanh(x, inplace=True)
        return y + x

    def viewed(x):
        h = x * 2 - 1
        v = h.view(-1)  # a view taken before the writes sees them
        F.relu(h, inplace=True)
        F.hardsigmoid(h, inplace=True)
        return h.exp() + 1, v * 2

    for fn in (of_input, viewed):
        x = torch.randn(4, 6)
        x_eager = x.clone()
        jitted = keraunos.jit(fn, fuse="wait")
        got = jitted(x)
        want = fn(x_eager)
        assert_close(got, want, **TOL)
        assert_close(x, x_eager, **TOL)  # the input as eager left it
        x, x_eager = torch.randn(4, 6), None
        x_eager = x.clone()
        assert_close(jitted(x), fn(x_eager), **TOL)  # the cached entry
        assert_close(x, x_eager, **TOL)


class _ResidualBlock(nn.Module):
    """torchvision's BasicBlock: ``out += identity`` after the second batch norm, then a relu
    applied in place; with a hardswish applied in place after the first (mobilenet's)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.hardswish, self.relu = nn.Hardswish(inplace=True), nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn2(self.conv2(self.hardswish(self.bn1(self.conv1(x)))))
        out += x
        return self.relu(out)


def _lines_outside_regions(trace):
    return [b for b in trace.bound_symbols
            if not isinstance(b.symbol, fusion.FusionSymbol) and hasattr(b.symbol, "fn")]


def test_residual_blocks_fuse_whole_in_eval_and_in_the_training_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _ResidualBlock(), _ResidualBlock())
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    jitted = keraunos.jit(model.eval(), fuse="wait")
    with torch.no_grad():
        assert_close(jitted(x), eager.eval()(x), **TOL)
    # Each block's bn2, add_ and relu in its region: only the stem's convolution stays out.
    outside = _lines_outside_regions(keraunos.last_traces(jitted)[-1])
    assert [b.symbol.name for b in outside] == ["torch.conv2d"]
    # Training: the forward runs batch norm and hardswish as ATen calls (``aten.clone`` saves
    # the value hardswish_ overwrites); they join the regions too.
    jitted = keraunos.jit(model.train(), fuse="wait")
    out, want = jitted(x), eager.train()(x)
    assert_close(out, want, **TOL)
    outside = _lines_outside_regions(keraunos.last_traces(jitted)[-1])
    assert not [b.symbol.name for b in outside if "hardswish" in b.symbol.name
                or "clone" in b.symbol.name and "num_batches" not in b.outputs.name]
    out.square().sum().backward()
    want.square().sum().backward()
    assert_grads_match(model, eager, **TOL)
    for (name, buffer), want_buffer in zip(model.named_buffers(), eager.buffers()):
        assert_close(buffer, want_buffer, **TOL, msg=name)


def test_in_place_activation_after_a_write_that_another_line_read_stays_exact():
    def read_between(x, y):
        h = x * 2
        h.add_(y)
        total = h.sum(0)  # reads the written memory before relu writes it again
        F.relu(h, inplace=True)
        return h * 3, total

    def of_a_view(x, y):
        h = x * 2
        h[0].add_(y[0])  # writes part of h through a view, then relu writes all of it
        F.relu(h, inplace=True)
        return h + 1

    for fn in (read_between, of_a_view):
        x, y = torch.randn(4, 6), torch.randn(4, 6)
        jitted = keraunos.jit(fn, fuse="wait")
        assert_close(jitted(x, y), fn(x, y), **TOL)
        x, y = torch.randn(4, 6), torch.randn(4, 6)
        assert_close(jitted(x, y), fn(x, y), **TOL)  # the cached entry


def _relaid(region) -> list[str]:
    """The targets of the nodes that read a channels-last copy made in the region's graph."""
    copies = {n for n in region.graph.graph.nodes if n.target is torch.ops.aten.clone.default
              and n.kwargs.get("memory_format") is torch.channels_last}
    return [n.target.__name__ for n in region.graph.graph.nodes
            if n.op == "call_function" and any(a in copies for a in n.args)]


def test_regions_keep_eager_layout_and_grouped_convolutions_run_on_channels_last_copies():
    from keraunos.executors.fusion import channels_last
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1),
                          nn.BatchNorm2d(8))
    grouped = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.Hardswish(),
                            nn.Conv2d(8, 8, 3, groups=8), nn.BatchNorm2d(8))
    x = torch.randn(2, 3, 8, 8)
    for model, relaid in ((dense, []), (grouped, ["conv2d"])):
        jitted = keraunos.jit(model.eval(), fuse="wait")
        with torch.no_grad():
            assert_close(jitted(x), model(x), **TOL)
        (region,) = keraunos.last_fusions(jitted)
        # keraunos places every convolution: Inductor's per-graph choice is off in both
        assert channels_last.layout_optimization(region.lines) is False
        # only the grouped convolution reads a channels-last copy
        assert _relaid(region) == relaid
        # and Inductor no longer copies the images into channels-last
        assert "(192, 1, 24, 3)" not in region.kernel_code


@pytest.fixture
def one_thread():
    """One intra-op thread (ATen runs a 1x1 convolution of a small batch on ``_slow_conv2d``
    only then), restored after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pointwise_convolutions() -> nn.Module:
    """1x1 convolutions as efficientnet_b0's last blocks have them, on images of 2x2 pixels."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(64, 96, 1, bias=False), nn.BatchNorm2d(96), nn.SiLU(),
                         nn.Conv2d(96, 96, 3, padding=1, groups=96, bias=False),
                         nn.BatchNorm2d(96), nn.SiLU(), nn.Conv2d(96, 32, 1, bias=False),
                         nn.BatchNorm2d(32))


def _fused_training_step(model, x):
    """One fused training step of ``model`` against eager's: outputs, gradients, running
    statistics; the regions of the fused program."""
    ref = copy.deepcopy(model)
    jitted = keraunos.jit(model, fuse="wait")
    out, want = jitted(x), ref(x)
    assert_close(out, want, **TOL)
    out.square().mean().backward()
    want.square().mean().backward()
    assert_grads_match(model, ref, require_all=True, **TOL)
    for (name, got), wanted in zip(model.named_buffers(), ref.buffers()):
        assert_close(got, wanted, **TOL, msg=name)
    assert keraunos.compile_stats(jitted).tier == "fused"
    return keraunos.last_fusions(jitted)


@pytest.mark.parametrize("size, threads, forward, backward", [
    (2, 1, ["conv2d"] * 3, ["convolution_backward.default"]),
    (4, 1, ["conv2d"], ["convolution_backward.default"]),
    (8, 1, ["conv2d"], []),
    (2, 2, ["conv2d"], []),
])
def test_small_pointwise_convolutions_run_on_channels_last_copies(size, threads, forward,
                                                                  backward):
    """On ATen's ``_slow_conv2d`` path (one thread) a 1x1 convolution runs channels-last at
    2x2 pixels, its backward up to 4x4; the grouped convolution's forward always does, its
    backward never. With two threads ATen runs 1x1 convolutions on mkldnn: not relaid. (The
    last convolution's backward reads only BatchNorm's backward, which runs outside regions:
    it runs as eager runs it, on torch.)"""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        regions = _fused_training_step(_pointwise_convolutions().train(),
                                       torch.randn(2, 64, size, size))
    finally:
        torch.set_num_threads(saved)
    assert [t for r in regions if r.trace_name == "computation" for t in _relaid(r)] == forward
    assert [t for r in regions if r.trace_name == "backward" for t in _relaid(r)] == backward


class _FunctionalConvolutions(nn.Module):
    """``F.conv2d`` with its options by keyword, as a user writes it: a grouped 3x3 one with
    ``padding="same"``, then a 1x1 one with a bias."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Parameter(torch.randn(16, 4, 3, 3) * 0.2)
        self.pointwise = nn.Parameter(torch.randn(24, 16, 1, 1) * 0.2)
        self.bias = nn.Parameter(torch.randn(24))

    def forward(self, x):
        h = F.silu(F.conv2d(x, self.grouped, padding="same", groups=4))
        return F.conv2d(h, self.pointwise, bias=self.bias).tanh()


def _convolution_case(case: str):
    torch.manual_seed(0)
    if case == "grouped, strided, with bias":
        model = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=4),
                              nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 8, 1))
        return model, torch.randn(2, 16, 8, 8), 1
    if case == "functional, by keyword":
        return _FunctionalConvolutions(), torch.randn(2, 16, 2, 2), 2
    if case == "one image, 1x1 with bias":
        model = nn.Sequential(nn.Conv2d(32, 48, 1), nn.BatchNorm2d(48), nn.Hardswish(),
                              nn.Conv2d(48, 16, 1))
        return model, torch.randn(1, 32, 2, 2), 2
    if case == "squeeze-excitation, 1x1 pixels":
        model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(32, 8, 1), nn.ReLU(),
                              nn.Conv2d(8, 32, 1), nn.Sigmoid())
        return model, torch.randn(2, 32, 4, 4), 0
    # a model and images already channels-last: nothing to relay
    model = _pointwise_convolutions().to(memory_format=torch.channels_last)
    return model, torch.randn(2, 64, 2, 2).contiguous(memory_format=torch.channels_last), 0


@pytest.mark.parametrize("case", ["grouped, strided, with bias", "functional, by keyword",
                                  "one image, 1x1 with bias", "squeeze-excitation, 1x1 pixels",
                                  "channels-last model and images"])
def test_relaid_convolutions_train_as_eager_does(case, one_thread):
    """Convolutions of other shapes and spellings than torchvision's: each fused training step
    against eager's, and which of them the rule relays in the forward."""
    model, x, relaid = _convolution_case(case)
    regions = _fused_training_step(model.train(), x)
    assert len([t for r in regions if r.trace_name == "computation"
                for t in _relaid(r)]) == relaid


def test_write_through_a_view_of_a_written_input_in_a_training_forward_is_kept():
    """Fuzz 7000:173. The forward of the autograd split holds the capture's ``a[:, 1:3]`` and the
    lowered ``aten.clamp_`` of it, whose proxies carry different storage numbers for one memory;
    a region that handed the view out as a new tensor lost the write."""
    def f(a):
        a.abs_()
        a[:, 1:3].clamp_(-0.5, 0.5)
        return a

    leaf = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    jitted = keraunos.jit(f, executors=FUSED, fuse="wait")
    with fusion.regions.fusing_single_ops():
        got = jitted(leaf.clone())
    want = f(leaf.clone())
    assert_close(got, want, **TOL)
    got.sum().backward()
    grad = leaf.grad.clone()
    leaf.grad = None
    want.sum().backward()
    assert_close(grad, leaf.grad, **TOL)
