"""The CUDA paths against eager on the GPU: fused regions (Inductor's Triton kernels), the
tier switch, dropout under CUDA's generator, a training step and a torchvision model.

Every test here skips without a CUDA device (these machines have none); ``scripts/gpu_check.sh``
runs this file, the tier tests and the tiers benchmark on a GPU machine within 8 minutes.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import keraunos
from keraunos.executors.fusion.compiler import toolchain_problem
from keraunos.testing.zoo import assert_same_grads

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(torch.cuda.is_available() and toolchain_problem("cuda") is not None,
                       reason="Inductor cannot build CUDA kernels here (Triton is missing)"),
]

TOLERANCE = dict(rtol=1e-3, atol=1e-4)  # Triton's kernels round differently from eager's
WAIT_S = 600


class Net(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64)
        self.p = p

    def forward(self, x):
        h = self.norm(self.fc1(x))
        h = F.gelu(h) * torch.sigmoid(h) + 0.5 * h
        h = F.dropout(torch.tanh(h).exp(), self.p, self.training)
        return self.fc2(h) + x


def _twins(p: float = 0.0):
    torch.manual_seed(0)
    model = Net(p).cuda()
    return model, copy.deepcopy(model)


def test_fused_program_on_cuda_matches_eager():
    model, eager = _twins()
    jitted = keraunos.jit(model.eval(), fuse="wait")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        assert_close(jitted(x), eager.eval()(x), **TOLERANCE)
        assert_close(jitted(x), eager(x), **TOLERANCE)
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert keraunos.last_fusions(jitted)


def test_switch_on_cuda_and_training_across_it():
    model, eager = _twins()
    jitted = keraunos.jit(model, fuse="background")
    x = torch.randn(8, 64, device="cuda")
    for step in range(3):  # tier 0, then (after the wait) the fused tier
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        loss = jitted(x).square().mean()
        want = eager(x).square().mean()
        loss.backward()
        want.backward()
        assert_close(loss, want, **TOLERANCE)
        assert_same_grads(model, eager, TOLERANCE)
        if step == 0:
            assert keraunos.wait_for_fusion(jitted, WAIT_S)
    assert keraunos.compile_stats(jitted).tier == "fused"


def test_dropout_draws_cudas_generator_values_on_either_tier():
    model, eager = _twins(p=0.3)
    jitted = keraunos.jit(model, fuse="background")
    x = torch.randn(8, 64, device="cuda")
    for step in range(3):
        torch.manual_seed(step)
        got = jitted(x)
        torch.manual_seed(step)
        assert_close(got, eager(x), **TOLERANCE)
        if step == 0:
            assert keraunos.wait_for_fusion(jitted, WAIT_S)
    assert keraunos.compile_stats(jitted).tier == "fused"


def test_a_litgpt_training_step_on_cuda_matches_eager():
    litgpt = pytest.importorskip("litgpt")
    from litgpt.model import GPT
    torch.manual_seed(0)
    config = litgpt.Config.from_name("Llama-2-7b-hf", n_layer=2, n_embd=128, n_head=2,
                                     n_query_groups=2, intermediate_size=256,
                                     padded_vocab_size=256, vocab_size=256, block_size=64)
    model = GPT(config).cuda()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model, fuse="wait")
    idx = torch.randint(0, 256, (2, 32), device="cuda")
    loss = jitted(idx).float().square().mean()
    want = eager(idx).float().square().mean()
    loss.backward()
    want.backward()
    assert_close(loss, want, **TOLERANCE)
    assert_same_grads(model, eager, dict(rtol=1e-2, atol=1e-3))


def test_resnet18_on_cuda_matches_eager():
    from keraunos.testing.vision import import_torchvision
    try:
        torchvision = import_torchvision()
    except ImportError as error:
        pytest.skip(f"torchvision is not installed ({error})")
    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda().eval()
    jitted = keraunos.jit(model, fuse="wait")
    x = torch.randn(4, 3, 64, 64, device="cuda")
    with torch.no_grad():
        assert_close(jitted(x), model(x), **TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_training_step_under_cuda_autocast_is_fused_as_close_to_float64_as_eager(dtype):
    # Capture writes CUDA autocast's casts (its lists differ from the CPU's: layer_norm and
    # softmax in float32) as lines; the fused program and its backward are Triton's.
    torch.manual_seed(0)
    model = Net().cuda()
    reference, exact_model = copy.deepcopy(model), copy.deepcopy(model).double()
    jitted = keraunos.jit(model, fuse="wait")
    x = torch.randn(8, 64, device="cuda")
    for m, run in ((model, jitted), (model, jitted), (reference, reference)):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            out = run(x)
        out.float().square().mean().backward()
    exact_model(x.double()).square().mean().backward()
    assert keraunos.compile_stats(jitted).tier == "fused"

    def distance(a, b):
        return (a.double() - b.double()).square().mean().sqrt().item()
    for (name, p), q, e in zip(model.named_parameters(), reference.parameters(),
                               exact_model.parameters()):
        assert distance(p.grad, e.grad) <= 3 * distance(q.grad, e.grad) + 1e-6, name
