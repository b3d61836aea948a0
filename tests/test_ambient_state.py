"""Ambient state (grad mode, autocast, determinism, ...) is checked by every prologue, from one list."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import keraunos
from keraunos.capture import ambient


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _misses(jitted):
    return " ".join(keraunos.last_cache_miss_reasons(jitted))


def test_autocast_dtype_change_recompiles_and_matches_eager():
    model = _mlp()
    jitted = keraunos.jit(model)
    x = torch.randn(3, 8)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            out, expected = jitted(x), model(x)
        assert out.dtype == expected.dtype == dtype
        assert_close(out, expected, rtol=0, atol=0)
    assert keraunos.cache_misses(jitted) == 2 and keraunos.cache_hits(jitted) == 1


def test_autocast_dtype_miss_names_the_setting():
    jitted = keraunos.jit(_mlp())
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jitted(x)
    with torch.autocast("cpu", dtype=torch.float16):
        jitted(x)
    assert "autocast dtype on cpu is float16, compiled with bfloat16" in _misses(jitted)


def test_autocast_gradients_follow_the_dtype_of_each_call():
    model = _mlp()
    jitted = keraunos.jit(model)
    x = torch.randn(3, 8)
    for dtype in (torch.bfloat16, torch.float16):
        for run in (jitted, model):
            model.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = run(x).float().square().sum()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            if run is jitted:
                jitted_grads = grads
        for got, expected in zip(jitted_grads, grads):
            assert_close(got, expected, rtol=0, atol=0)


def test_autocast_cache_enabled_is_checked():
    jitted = keraunos.jit(_mlp())
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jitted(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        jitted(x)
    assert keraunos.cache_misses(jitted) == 2
    assert "cast cache is off, compiled with on" in _misses(jitted)


def test_autocast_of_another_device_type_is_checked_separately():
    # The CUDA setting can be switched without a GPU; a program captured with it off is not
    # reused with it on (fail closed), and the CPU result is still eager's.
    model = _mlp()
    jitted = keraunos.jit(model)
    x = torch.randn(3, 8)
    jitted(x)
    previous = torch.is_autocast_enabled("cuda")
    torch.set_autocast_enabled("cuda", True)
    try:
        assert_close(jitted(x), model(x))
    finally:
        torch.set_autocast_enabled("cuda", previous)
    # Without a GPU the list leaves CUDA out; dynamo's C++ guard still compares it.
    assert "autocast" in _misses(jitted) and "cuda" in _misses(jitted)


def test_autocast_entered_inside_the_program_takes_the_ambient_dtype():
    def f(x, w):
        with torch.autocast("cpu"):  # no dtype: torch.get_autocast_dtype("cpu")
            return F.linear(x, w)

    jitted = keraunos.jit(f)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    previous = torch.get_autocast_dtype("cpu")
    try:
        for dtype in (torch.bfloat16, torch.float16):
            torch.set_autocast_dtype("cpu", dtype)
            out, expected = jitted(x, w), f(x, w)
            assert out.dtype == expected.dtype == dtype
            assert_close(out, expected, rtol=0, atol=0)
    finally:
        torch.set_autocast_dtype("cpu", previous)
    assert keraunos.cache_misses(jitted) == 2


def test_inference_mode_and_no_grad_are_different_entries():
    def f(x):
        return x * 2 + 1

    jitted = keraunos.jit(f)
    x = torch.randn(4)
    with torch.no_grad():
        out = jitted(x)
    assert not out.is_inference()
    with torch.inference_mode():
        out, expected = jitted(x), f(x)
    assert out.is_inference() == expected.is_inference() is True
    assert_close(out, expected)
    assert keraunos.cache_misses(jitted) == 2
    assert "inference mode is on, compiled with off" in _misses(jitted)


def test_deterministic_algorithms_are_checked():
    jitted = keraunos.jit(lambda x: x.cumsum(0))
    x = torch.randn(5)
    jitted(x)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert_close(jitted(x), x.cumsum(0))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert "deterministic algorithms is on, compiled with off" in _misses(jitted)


def test_float32_matmul_precision_is_checked():
    jitted = keraunos.jit(lambda a, b: a @ b)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    jitted(a, b)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert_close(jitted(a, b), a @ b)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert keraunos.cache_misses(jitted) == 2
    assert "float32 matmul precision is 'medium', compiled with 'highest'" in _misses(jitted)


def test_unchanged_ambient_state_hits():
    jitted = keraunos.jit(_mlp())
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        jitted(x)
        jitted(x)
    assert keraunos.cache_hits(jitted) == 1 and keraunos.cache_misses(jitted) == 1


def test_a_new_kind_of_ambient_state_is_one_entry_in_the_list(monkeypatch):
    setting = {"on": False}
    # The prologue reads the setting through its expression (``torch`` is in its namespace).
    monkeypatch.setattr(torch, "_example_setting", lambda: setting["on"], raising=False)
    extra = ambient.Ambient("an example setting", "torch._example_setting()",
                            lambda: setting["on"], in_global_state_guard=False)
    monkeypatch.setattr(ambient, "AMBIENT_STATE", ambient.AMBIENT_STATE + (extra,))
    jitted = keraunos.jit(lambda x: x + 1)
    x = torch.randn(3)
    jitted(x)
    assert "an example setting" in str(keraunos.last_prologue_traces(jitted)[-1])
    setting["on"] = True
    assert_close(jitted(x), x + 1)
    assert keraunos.cache_misses(jitted) == 2
    assert "an example setting is on, compiled with off" in _misses(jitted)


@pytest.mark.parametrize("cxx", [True, False], ids=["cxx-guard", "python-only"])
def test_every_entry_is_checked_with_or_without_the_cxx_guard(monkeypatch, cxx):
    if not cxx:
        monkeypatch.setattr(ambient, "GlobalStateGuard", None)
    jitted = keraunos.jit(lambda x: x + 1)
    x = torch.randn(3)
    jitted(x)
    prologue = str(keraunos.last_prologue_traces(jitted)[-1])
    assert ("_global_state" in prologue) == cxx
    with torch.autocast("cpu", dtype=torch.float16):
        jitted(x)
    assert "autocast on cpu is on, compiled with off" in _misses(jitted)


def test_matmul_precision_set_per_backend_is_checked_without_raising():
    # torch.get_float32_matmul_precision() raises once a precision is set per backend: the
    # prologue then reads the backends' precisions one by one, and gives eager's results.
    jitted = keraunos.jit(lambda a, b: a @ b)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    jitted(a, b)
    previous = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        for _ in range(2):
            assert_close(jitted(a, b), a @ b, rtol=0, atol=0)
        misses = keraunos.cache_misses(jitted)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous
    assert misses == 2 and keraunos.cache_hits(jitted) == 1
    assert torch.get_float32_matmul_precision() == "highest"  # restored: one name again
    assert_close(jitted(a, b), a @ b, rtol=0, atol=0)
    assert keraunos.cache_misses(jitted) == 2  # the first entry again
