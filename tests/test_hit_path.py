"""The hit path: the most recently used entry's checks, computation and epilogue in one generated
function (``hit_path.hit_path``). Every behaviour is compared with eager PyTorch."""
import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.runtime.call import state_of


def _front(jitted):
    return state_of(jitted).entries[0]


def test_hit_path_gives_eager_results_and_counts_hits():
    def f(x):
        return (x * 2 + 1).relu()

    jitted = keraunos.jit(f)
    x = torch.randn(4)
    for _ in range(3):
        assert_close(jitted(x), f(x))
    assert (keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)) == (1, 2)


def test_hit_path_is_a_readable_function():
    jitted = keraunos.jit(lambda x: x.exp() + 1)
    jitted(torch.randn(3))
    source = str(_front(jitted).hit_trace)
    assert "def hit(args, kwargs):" in source
    assert "_entry.computation_fn(x)" in source  # the epilogue only returns the one output
    assert "Constructed by Hit Path" in source


def test_hit_path_calls_the_epilogue_that_rebuilds_the_result():
    def f(x):
        return {"double": x * 2, "pair": (x + 1, x)}

    jitted = keraunos.jit(f)
    x = torch.randn(3)
    jitted(x)
    out, expected = jitted(x), f(x)
    assert_close(out, expected)
    assert out["pair"][1] is x  # the input itself, as eager returns it
    assert "_entry.epilogue_fn(" in str(_front(jitted).hit_trace)


def test_error_of_the_program_on_a_hit_propagates_without_recompiling():
    def f(x, index):
        return x.index_select(0, index)

    jitted = keraunos.jit(f)
    x = torch.randn(4)
    jitted(x, torch.tensor([1, 2]))
    bad = torch.tensor([1, 7])  # same metadata: the entry's checks pass
    with pytest.raises((IndexError, RuntimeError)) as expected:
        f(x, bad)
    with pytest.raises(type(expected.value)):
        jitted(x, bad)
    assert keraunos.cache_misses(jitted) == 1


def test_entries_behind_the_front_one_are_served_by_their_own_hit_paths():
    # One way to accept a call in Python: the general path calls each entry's hit path too.
    def f(x, index):
        return x.index_select(0, index) * 2

    jitted = keraunos.jit(f, dynamic=False)
    small, large, index = torch.randn(4), torch.randn(6), torch.tensor([1, 2])
    jitted(small, index)
    jitted(large, index)  # a second entry, now in front
    behind = state_of(jitted).entries[1]
    calls, hit = [], behind.hit_fn
    behind.hit_fn = lambda args, kwargs: calls.append(args) or hit(args, kwargs)
    assert_close(jitted(small, index), f(small, index))
    assert len(calls) == 1 and state_of(jitted).entries[0] is behind  # it moved to the front
    assert state_of(jitted).last_entry is behind
    assert (keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)) == (2, 1)
    # Its program's own error, found by its hit path, is raised once and not compiled again.
    jitted(large, index)  # declined by it (a call of its hit path), the other in front again
    with pytest.raises((IndexError, RuntimeError)) as expected:
        f(small, torch.tensor([1, 7]))
    with pytest.raises(type(expected.value)):
        jitted(small, torch.tensor([1, 7]))
    assert len(calls) == 3 and keraunos.cache_misses(jitted) == 2


def test_written_input_passed_twice_misses_as_eager_needs():
    def f(a, b):
        a.add_(b)
        return a * 2

    jitted = keraunos.jit(f)
    a, b = torch.randn(4), torch.randn(4)
    jitted(a.clone(), b)
    for _ in range(2):  # the second time on the hit path of the entry the first compiled
        x, x_eager = torch.randn(4), None
        x_eager = x.clone()
        assert_close(jitted(x, x), f(x_eager, x_eager))
        assert_close(x, x_eager)
    assert keraunos.cache_misses(jitted) == 2


def test_inference_mode_under_enable_grad_is_still_a_miss():
    # Grad mode is on in both calls: only the tensor checks tell inference mode apart.
    def f(x):
        return x * 2

    jitted = keraunos.jit(f)
    x = torch.randn(3)
    assert not jitted(x).is_inference()
    with torch.inference_mode(), torch.enable_grad():
        out, expected = jitted(x), f(x)
    assert out.is_inference() == expected.is_inference() is True
    assert_close(out, expected)
    assert keraunos.cache_misses(jitted) == 2
    assert "inference mode is on, compiled with off" in " ".join(
        keraunos.last_cache_miss_reasons(jitted))
    assert not jitted(x).is_inference()  # and back


def test_inference_mode_is_checked_in_python_without_tensor_checks():
    jitted = keraunos.jit(lambda n: n + 1)
    assert jitted(2) == 3
    assert "_is_inference_mode_enabled()" in str(keraunos.last_prologue_traces(jitted)[-1])
    with torch.inference_mode():
        assert jitted(2) == 3
    assert keraunos.cache_misses(jitted) == 2


def test_last_traces_follow_the_entry_that_ran_last():
    jitted = keraunos.jit(lambda x: x + 1, dynamic=False)
    small, large = torch.randn(2), torch.randn(5)
    jitted(small)
    jitted(large)
    jitted(small)  # the general path: the second entry
    jitted(small)  # the hit path of the same entry
    assert "f32[2]" in str(keraunos.last_traces(jitted)[-1])
    stats = keraunos.compile_stats(jitted)
    assert not stats.last_call_compiled and stats.last_cache_lookup > 0
    assert (stats.cache_misses, stats.cache_hits) == (2, 2)
    jitted(large)
    assert "f32[5]" in str(keraunos.last_traces(jitted)[-1])


def test_tier_switch_is_seen_by_the_hit_path():
    jitted = keraunos.jit(lambda x: x * 3)
    x = torch.randn(3)
    jitted(x)
    entry = _front(jitted)
    calls = []
    original = entry.computation_fn

    def switched(*inputs):
        calls.append(len(inputs))
        return original(*inputs)
    entry.computation_fn = switched  # what runtime/tiers.py's switch does
    assert_close(jitted(x), x * 3)
    assert calls == [1]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def test_many_tensors_checked_by_the_guard_tree_miss_on_a_parameter_change():
    model = _mlp()
    jitted = keraunos.jit(model)
    x = torch.randn(2, 8)
    jitted(x)
    assert "_tensor_guards0.check((" in str(keraunos.last_prologue_traces(jitted)[-1])
    model[2].weight.requires_grad_(False)
    out = jitted(x)
    assert_close(out, model(x))
    out.sum().backward()
    assert model[2].weight.grad is None and model[0].weight.grad is not None
    reasons = " ".join(keraunos.last_cache_miss_reasons(jitted))
    assert "tensor 'module.2.weight' requires_grad mismatch" in reasons
    assert "torch._dynamo.config" not in reasons


def test_many_tensors_tell_inference_mode_apart():
    model = _mlp()
    jitted = keraunos.jit(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        jitted(x)
    with torch.inference_mode():
        out, expected = jitted(x), model(x)
    assert out.is_inference() == expected.is_inference() is True
    assert_close(out, expected)
    assert "inference mode is on, compiled with off" in " ".join(
        keraunos.last_cache_miss_reasons(jitted))
