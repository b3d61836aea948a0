"""A region's C++ kernels built by one g++ run (``executors/fusion/one_build.py``): the merged
kernels give eager's values and gradients, a failed merged build falls back to Inductor's one
build per kernel, and sources of another shape are left alone."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.executors.fusion import collecting, one_build
from keraunos.executors.fusion.compiler import toolchain_problem

pytestmark = pytest.mark.skipif(toolchain_problem("cpu") is not None,
                                reason="no working C++ compiler for Inductor's CPU kernels")


def step(x, w, b):
    """Regions of several kernels each: a reduction, a matrix product, pointwise lines after it."""
    h = torch.nn.functional.layer_norm((x * 2 + 1).relu(), (x.shape[-1],))
    a = (h.softmax(-1) * x.cos()) @ w
    return ((a + b).tanh() * 3 - 1).sigmoid().sum(-1) + a.mean(-1)


def inputs(n):
    torch.manual_seed(n)
    return (torch.randn(n, 24, requires_grad=True), torch.randn(24, 24, requires_grad=True),
            torch.randn(24, requires_grad=True))


def eager_and_jitted(n, fuse="wait"):
    """Forward and gradients, eager's and keraunos's, on inputs of ``n`` rows (a size no other
    test uses: every test compiles its own regions)."""
    xs = inputs(n)
    expected = step(*xs)
    expected.square().sum().backward()
    expected_grads = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    jitted = keraunos.jit(step, fuse=fuse)
    got = jitted(*xs)
    got.square().sum().backward()
    assert_close(got, expected)
    for x, g in zip(xs, expected_grads):
        assert_close(x.grad, g)
    return jitted


def test_a_regions_kernels_are_built_as_one_file_and_give_eagers_values():
    before = dict(one_build.stats)
    jitted = eager_and_jitted(7)
    merged = one_build.stats["merged"] - before["merged"]
    kernels = one_build.stats["kernels"] - before["kernels"]
    assert merged >= 1 and kernels >= 2 * merged  # (forward and backward: several kernels each)
    xs = inputs(7)  # later calls run the same merged kernels
    assert_close(jitted(*xs), step(*inputs(7)))


def test_a_merged_build_that_fails_is_built_kernel_by_kernel(monkeypatch):
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    original, refused, alone = CppPythonBindingsCodeCache.load_async, [], []

    def load_async(source, *args, **kwargs):
        if "keraunos_kernel_" in source:
            refused.append(source)
            raise RuntimeError("no merged build here")
        alone.append(source)
        return original(source, *args, **kwargs)
    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_async", staticmethod(load_async))
    eager_and_jitted(9)
    assert refused and len(alone) >= 2


def test_the_background_tier_runs_merged_kernels():
    jitted = eager_and_jitted(11, fuse="background")
    assert keraunos.wait_for_fusion(jitted, timeout=600)
    xs = inputs(11)
    expected = step(*xs)
    expected.sum().backward()
    grads = [x.grad.clone() for x in xs]
    xs = inputs(11)
    got = jitted(*xs)
    got.sum().backward()
    assert_close(got, expected)
    for x, g in zip(xs, grads):
        assert_close(x.grad, g)


def test_only_sources_of_the_usual_shape_are_merged():
    kernel = ('#include <torch/csrc/inductor/cpp_prefix.h>\n'
              'extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)\n'
              '{ out_ptr0[0] = in_ptr0[0]; }\n')
    assert one_build.mergeable(kernel)
    assert not one_build.mergeable(kernel.replace("\n{", '\n#include <cmath>\n{'))
    assert not one_build.mergeable(kernel + 'extern "C" void other() {}\n')
    assert not one_build.mergeable(kernel.replace("kernel(", "entry("))


def test_the_merged_source_names_each_kernel_once():
    assert one_build.usable()
    sources = [('#include <torch/csrc/inductor/cpp_prefix.h>\n'
                f'extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)\n'
                f'{{ out_ptr0[0] = in_ptr0[0] + {i}; }}\n') for i in range(3)]
    merged = one_build.merged_source([one_build.Pending(["const float*", "float*"], s)
                                      for s in sources])
    assert merged.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert 'extern "C"' not in merged.split("Python bindings")[0]
    for i in range(3):
        assert f"namespace keraunos_kernel_{i} {{" in merged
        assert f'"k{i}"' in merged and f"k{i}_py" in merged  # its method table entry
        assert f"keraunos_kernel_{i}::kernel(parse_arg<float*>(args, 0), " \
               f"parse_arg<float*>(args, 1))" in merged
    assert merged.count("PyInit_kernel") == 1
    # and it builds, and each binding calls its own kernel
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    module = CppPythonBindingsCodeCache.load_async(merged, "cpu")()
    src, out = torch.tensor([1.5]), torch.zeros(1)
    for i in range(3):
        getattr(module, f"k{i}")(src, out)
        assert out.item() == 1.5 + i


def test_outside_a_compile_inductor_builds_as_its_own():
    assert getattr(one_build._local, "batch", None) is None
    assert one_build.start() is None
    with collecting.from_inductor():
        assert one_build._local.batch == []
    assert one_build._local.batch is None
