"""A program that changes a list, dict or set in its globals or a closure: undone at capture and
run through the fallback, so every call does it, as in eager; never a fake tensor left behind."""
import warnings

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.errors import ScopeMutationError

CALLS = []
SEEN = {}


def _counting(x):
    CALLS.append(1)
    return x * len(CALLS)


def _remembering(x):
    SEEN["last"] = x.sum()
    return x + 1


def _run(fn, calls=3):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's one warning
        return [fn(torch.ones(2) * (i + 1)) for i in range(calls)]


def test_a_global_list_appended_to_grows_on_every_call_as_in_eager():
    CALLS.clear()
    expected = _run(_counting)
    eager_calls = list(CALLS)
    CALLS.clear()
    for got, want in zip(_run(keraunos.jit(_counting)), expected):
        assert_close(got, want)
    assert CALLS == eager_calls == [1, 1, 1]


def test_a_tensor_stored_in_a_global_dict_is_a_real_tensor_of_the_last_call():
    SEEN.clear()
    _run(keraunos.jit(_remembering))
    assert type(SEEN["last"]) is torch.Tensor
    assert_close(SEEN["last"], torch.tensor(6.0))


def test_a_closure_list_changed_by_a_helper_is_seen():
    log = []

    def note(t):
        log.append(t.shape[0])

    def f(x):
        note(x)
        return x.cos()

    expected = _run(f)
    eager_log = list(log)
    log.clear()
    for got, want in zip(_run(keraunos.jit(f)), expected):
        assert_close(got, want)
    assert log == eager_log


def test_with_fallback_error_the_change_is_undone_and_refused():
    CALLS.clear()
    with pytest.raises(ScopeMutationError, match="the global `CALLS`"):
        keraunos.jit(_counting, fallback="error")(torch.ones(2))
    assert CALLS == []  # the cache and the program's state are as they were


def test_reading_a_global_list_without_changing_it_compiles_one_trace():
    sizes = [2, 3]

    def f(x):
        return x * len(sizes) + sizes[0]

    jitted = keraunos.jit(f, fallback="error")
    for _ in range(2):
        assert_close(jitted(torch.ones(2)), f(torch.ones(2)))
    assert keraunos.cache_hits(jitted) == 1
