"""torchvision's image models (random weights) under keraunos.jit, against eager.

resnet18, mobilenet_v3_small and efficientnet_b0: eval outputs, and one training step (outputs
under dropout's draws, every gradient, and batch norm's running statistics, which the step
updates in place). On the torch tier, then on the fused tier (``fuse="wait"``), and across the
switch of the default (``fuse="background"``).

torchvision is imported by ``keraunos.testing.vision.import_torchvision``: the wheel beside the
CPU torch on these machines is a CUDA build whose extension does not load (see that module).
"""
import copy
import os

import pytest
import torch

import keraunos
from keraunos.executors.fusion.compiler import toolchain_problem
from keraunos.testing.vision import import_torchvision
from keraunos.testing.zoo import assert_same_grads

try:
    torchvision = import_torchvision()
except ImportError as error:  # not installed: the test extra installs it
    pytest.skip(f"torchvision is not installed ({error}); pip install -e '.[test]'",
                allow_module_level=True)

MODELS = ("resnet18", "mobilenet_v3_small", "efficientnet_b0")
# Inductor's kernels round differently from eager's (as in test_fusion.py); batch norm's
# statistics over a batch of 2 amplify it in the gradients.
FUSED_TOLERANCE = dict(rtol=2e-3, atol=2e-4)
# A cold fused compile of these models takes 10-80 s on 2 cores: the suite fuses resnet18's eval,
# and every fused case runs with KERAUNOS_SLOW_TESTS=1 (docs/benchmarks.md, "Vision").
SLOW = os.environ.get("KERAUNOS_SLOW_TESTS") == "1"
needs_compiler = pytest.mark.skipif(toolchain_problem("cpu") is not None,
                                    reason="Inductor cannot build CPU kernels here (no C++ compiler)")


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(torchvision.models, name)()


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _assert_same_buffers(model, ref, tolerance):
    ref_buffers = dict(ref.named_buffers())
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, ref_buffers[name], msg=lambda m, name=name: f"{name}: {m}",
                                   **tolerance)


def _check_eval(name, tolerance, **jit_options):
    model = _model(name).eval()
    jmodel = keraunos.jit(model, **jit_options)
    x = _images()
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(jmodel(x), want, **tolerance)
        torch.testing.assert_close(jmodel(x), want, **tolerance)  # the cached entry
    return jmodel


def _check_train_step(name, tolerance, **jit_options):
    model = _model(name).train()
    ref = copy.deepcopy(model)
    jmodel = keraunos.jit(model, **jit_options)
    x = _images()
    torch.manual_seed(7)
    out = jmodel(x)
    torch.manual_seed(7)
    want = ref(x)
    torch.testing.assert_close(out, want, **tolerance)
    out.square().mean().backward()
    want.square().mean().backward()
    assert_same_grads(model, ref, tolerance)
    _assert_same_buffers(model, ref, tolerance)  # running_mean, running_var, num_batches_tracked
    return jmodel


@pytest.mark.parametrize("name", MODELS)
def test_eval_on_the_torch_executor(name):
    jmodel = _check_eval(name, {}, fuse="off")
    assert keraunos.compile_stats(jmodel).cache_misses == 1


@pytest.mark.parametrize("name", MODELS)
def test_training_step_on_the_torch_executor(name):
    _check_train_step(name, {}, fuse="off")


def _fused_cases(suite_case: str | None):
    return [pytest.param(name, marks=pytest.mark.long) if SLOW or name == suite_case else
            pytest.param(name, marks=pytest.mark.skip(
                reason=f"a cold fused compile of {name} takes up to 80 s; "
                       f"KERAUNOS_SLOW_TESTS=1 runs it"))
            for name in MODELS]


@needs_compiler
@pytest.mark.parametrize("name", _fused_cases("resnet18"))
def test_eval_on_the_fused_tier(name):
    jmodel = _check_eval(name, FUSED_TOLERANCE, fuse="wait")
    assert keraunos.compile_stats(jmodel).tier == "fused"


@needs_compiler
@pytest.mark.parametrize("name", _fused_cases(None))
def test_training_step_on_the_fused_tier(name):
    jmodel = _check_train_step(name, FUSED_TOLERANCE, fuse="wait")
    assert keraunos.compile_stats(jmodel).tier == "fused"
