"""The fast paths are on for the installed torch, and where one is off, ``compile_stats`` says
which path served the calls and why: the native hit path (``keraunos/runtime/native``), the one-file
build of a fused module's C++ kernels (``executors/fusion/one_build.py``), and the torch
release check at import (``keraunos/version.py``). Run on every torch release the suite is run
on, these are what a release that changed torch's internals fails first."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.runtime import native
from keraunos import version
from keraunos.executors.fusion import one_build
from keraunos.executors.fusion.compiler import toolchain_problem


@pytest.fixture(scope="module")
def _native_loaded():
    if native.LOADER.start(wait=True) is None:
        pytest.fail(f"the native hit path could not be built: {native.LOADER.failed}")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def test_the_native_hit_path_serves_a_module_and_says_so(_native_loaded):
    model, x = _mlp(), torch.randn(4, 16)
    jitted = keraunos.jit(model, fuse="off")
    for _ in range(3):
        assert_close(jitted(x), model(x))
    stats = keraunos.compile_stats(jitted)
    assert stats.hit_path == "native", stats.hit_path
    assert "hit path: native" in str(stats)


def test_an_entry_the_native_path_cannot_take_says_why(_native_loaded):
    def f(a, b):  # two tensor arguments: they may share memory, checked in Python
        return (a * b).sin() + 1

    jitted, x = keraunos.jit(f, fuse="off"), torch.randn(5)
    for _ in range(2):
        assert_close(jitted(x, x), f(x, x))
    stats = keraunos.compile_stats(jitted)
    assert stats.hit_path.startswith("python (") and len(stats.hit_path) > len("python ()")


def test_a_native_path_that_is_not_loaded_is_reported_with_the_reason(monkeypatch):
    monkeypatch.setattr(native.LOADER, "module", None)
    monkeypatch.setattr(native.LOADER, "built", None)  # (nothing for a poll to import)
    monkeypatch.setattr(native.LOADER, "failed", "CalledProcessError: g++ exited with 1")
    model, x = _mlp(), torch.randn(4, 16)
    jitted = keraunos.jit(model, fuse="off")
    for _ in range(2):
        assert_close(jitted(x), model(x))
    assert keraunos.compile_stats(jitted).hit_path == (
        "python (the native hit path is not available: CalledProcessError: g++ exited with 1)")
    monkeypatch.setattr(native.LOADER, "failed", None)
    monkeypatch.setenv("KERAUNOS_NATIVE", "0")
    assert native.unavailable() == "the native hit path is off (KERAUNOS_NATIVE=0)"


def test_this_torchs_kernel_binding_template_is_one_the_merge_reads():
    assert one_build.usable(), "this torch's Inductor binding template changed: see one_build"


@pytest.mark.skipif(toolchain_problem("cpu") is not None, reason="no working C++ compiler")
def test_a_fused_module_reports_its_kernels_built_as_one_file(_native_loaded):
    def f(x, w):
        h = (x * 2 + 1).relu() @ w
        return (h.softmax(-1) * h.cos()).sum(-1) + h.mean(-1)

    torch.manual_seed(3)
    x, w = torch.randn(11, 13), torch.randn(13, 13)
    jitted = keraunos.jit(f, fuse="wait")
    failed_before = one_build.stats["failed"]
    for _ in range(2):
        assert_close(jitted(x, w), f(x, w))
    stats = keraunos.compile_stats(jitted)
    assert stats.tier == "fused"
    assert stats.kernel_build == "one file per module", stats.kernel_build
    assert one_build.stats["failed"] == failed_before


def test_a_merged_build_failure_is_reported():
    saved = dict(one_build.stats), list(one_build._first_failure)
    try:
        one_build._failed(RuntimeError("g++ said no\nmore lines"))
        text = one_build.describe()
        assert "failed and were built one by one" in text and "g++ said no" in text
    finally:
        one_build.stats.update(saved[0])
        one_build._first_failure[:] = saved[1]


def test_this_torch_is_a_tested_release_and_others_warn_at_import():
    assert version.check_torch(torch.__version__) is None
    assert version.release_of("2.15.0+cu132") == (2, 15)
    for other in ("2.12.1", "2.16.0.dev20261201", "3.0.0"):
        why = version.check_torch(other)
        assert why is not None and other in why and "2.13, 2.14, 2.15" in why
    # A torch outside the range warns once at import, naming it (the check is the same function).
    code = ("import warnings, torch; torch.__version__ = '2.12.0'; "
            "warnings.simplefilter('always'); import keraunos")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("is tested on torch 2.13, 2.14, 2.15; this is torch 2.12.0") == 1
