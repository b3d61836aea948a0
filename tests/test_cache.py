"""The prologue's checks and the cache: what recompiles, what hits, the cache modes, threads."""
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import keraunos


def counts(jitted):
    return keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)


def reasons_mention(jitted, *words):
    """Whether some miss reason of the last miss mentions every one of ``words``."""
    reasons = keraunos.last_cache_miss_reasons(jitted)
    return any(all(w in r for w in words) for r in reasons), reasons


def assert_recompiles_then_hits(jf, f, first, second, *reason_words):
    """Calling with ``first`` then ``second`` (tuples of args) recompiles, gives eager's results,
    explains the miss with ``reason_words``, and calling with ``second`` again hits."""
    assert_close(jf(*first), f(*first))
    assert counts(jf) == (1, 0)
    assert_close(jf(*second), f(*second))
    assert counts(jf) == (2, 0)
    ok, reasons = reasons_mention(jf, *reason_words)
    assert ok, reasons
    assert_close(jf(*second), f(*second))
    assert counts(jf) == (2, 1)


# ----------------------------------------------------------------- same call, same entry
def test_same_call_hits():
    f = lambda x: x.sin()  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    jf(x)
    jf(x)
    jf(torch.randn(3))
    assert counts(jf) == (1, 2)


def test_switching_back_to_an_earlier_shape_hits():
    jf = keraunos.jit(lambda x: x * 2)
    a, b = torch.randn(2), torch.randn(3)
    jf(a)
    jf(b)
    jf(a)
    jf(b)
    assert counts(jf) == (2, 2)


# ------------------------------------------------------------------------- tensor metadata
def test_changed_shape_recompiles():
    f = lambda x: x.sum(0) + x.shape[0]  # noqa: E731
    assert_recompiles_then_hits(keraunos.jit(f), f, (torch.randn(2, 3),), (torch.randn(4, 3),),
                                "size mismatch")


def test_changed_dtype_recompiles():
    f = lambda x: x / 2  # noqa: E731
    jf = keraunos.jit(f)
    assert_recompiles_then_hits(jf, f, (torch.arange(4),), (torch.arange(4.0),), "dtype")
    assert jf(torch.arange(4.0)).dtype == torch.float32


def test_changed_requires_grad_recompiles():
    f = lambda x: x * 3  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_recompiles_then_hits(jf, f, (x,), (x.clone().requires_grad_(),), "requires_grad")
    assert jf(x.clone().requires_grad_()).requires_grad


def test_changed_stride_gives_eager_result():
    f = lambda x: x.view(-1) if x.is_contiguous() else x.reshape(-1) * 10  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3, 3)
    assert_close(jf(x), f(x))
    assert_close(jf(x.t()), f(x.t()))
    assert counts(jf) == (2, 0)


# ---------------------------------------------------------------------------- Python values
def test_changed_python_scalar_recompiles():
    f = lambda x, scale: x * scale  # noqa: E731
    x = torch.randn(3)
    assert_recompiles_then_hits(keraunos.jit(f), f, (x, 2.0), (x, 3.0), "args[1]", "2.0")


def test_int_versus_float_scalar_recompiles():
    f = lambda x, s: x * s  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.arange(3)
    assert_recompiles_then_hits(jf, f, (x, 2), (x, 2.0), "args[1]")
    assert jf(x, 2.0).dtype == torch.float32


def test_changed_bool_flag_recompiles():
    f = lambda x, flag: x + 1 if flag else x - 1  # noqa: E731
    x = torch.randn(3)
    assert_recompiles_then_hits(keraunos.jit(f), f, (x, True), (x, False), "args[1]")


def test_changed_string_argument_recompiles():
    def f(x, mode):
        return x.relu() if mode == "relu" else x.tanh()

    x = torch.randn(4)
    assert_recompiles_then_hits(keraunos.jit(f), f, (x, "relu"), (x, "tanh"), "args[1]", "relu")


def test_none_versus_tensor_recompiles():
    def f(x, bias):
        return x if bias is None else x + bias

    x = torch.randn(3)
    assert_recompiles_then_hits(keraunos.jit(f), f, (x, None), (x, torch.ones(3)), "args[1]")


def test_tensor_versus_none_recompiles():
    def f(x, bias):
        return x if bias is None else x + bias

    x = torch.randn(3)
    assert_recompiles_then_hits(keraunos.jit(f), f, (x, torch.ones(3)), (x, None), "args[1]")


def test_changed_keyword_argument_recompiles():
    f = lambda x, *, p=2: x ** p  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x, p=2), f(x, p=2))
    assert_close(jf(x, p=3), f(x, p=3))
    assert_close(jf(x), f(x))
    assert_close(jf(x, p=3), f(x, p=3))
    assert counts(jf) == (3, 1)


def test_changed_list_length_recompiles():
    f = lambda xs: torch.stack(xs).sum(0)  # noqa: E731
    x = torch.randn(3)
    assert_recompiles_then_hits(keraunos.jit(f), f, ([x, x],), ([x, x, x],), "args[0]", "length")


def test_changed_dict_keys_recompiles():
    def f(d):
        return sum(v * i for i, v in enumerate(d.values()))

    x = torch.randn(3)
    assert_recompiles_then_hits(keraunos.jit(f), f, ({"a": x, "b": x},), ({"a": x, "c": x},),
                                "keys")


def test_changed_dict_key_order_gives_eager_result():
    def f(d):
        return [k for k in d], sum(v * (i + 1) for i, v in enumerate(d.values()))

    jf = keraunos.jit(f)
    a, b = torch.randn(3), torch.randn(3)
    for d in ({"a": a, "b": b}, {"b": b, "a": a}):
        out, expected = jf(d), f(d)
        assert out[0] == expected[0]
        assert_close(out[1], expected[1])


def test_tuple_versus_list_gives_eager_result():
    f = lambda xs: (type(xs) is list, xs[0] + xs[1])  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(2)
    assert jf([x, x])[0] is True
    assert jf((x, x))[0] is False
    assert keraunos.cache_misses(jf) == 2


def test_changed_number_of_arguments_recompiles():
    f = lambda *xs: sum(xs)  # noqa: E731
    x = torch.randn(2)
    assert_recompiles_then_hits(keraunos.jit(f), f, (x, x), (x, x, x), "length")


# ------------------------------------------------------------------------------ global state
def test_changed_grad_mode_recompiles():
    f = lambda x: x * 2  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3, requires_grad=True)
    assert jf(x).requires_grad
    with torch.no_grad():
        out = jf(x)
        assert counts(jf) == (2, 0)
        ok, reasons = reasons_mention(jf, "grad mode is off")
        assert ok, reasons
        assert not out.requires_grad
        assert_close(out, f(x))
        jf(x)
    assert counts(jf) == (2, 1)
    assert jf(x).requires_grad


def test_changed_default_dtype_recompiles():
    f = lambda x: x + torch.ones(3)  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.ones(3, dtype=torch.float64)
    assert jf(x).dtype == torch.float64
    torch.set_default_dtype(torch.float64)
    out = jf(x)
    assert out.dtype == f(x).dtype
    assert counts(jf) == (2, 0)
    ok, reasons = reasons_mention(jf, "default dtype is")
    assert ok, reasons
    jf(x)
    assert counts(jf) == (2, 1)


def test_default_dtype_changes_factory_output():
    f = lambda x: (x, torch.zeros(2))  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.ones(1)
    assert jf(x)[1].dtype == torch.float32
    torch.set_default_dtype(torch.float64)
    assert jf(x)[1].dtype == torch.float64


# ------------------------------------------------------------------------------ module state
def test_changed_training_flag_recompiles():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    jm = keraunos.jit(m)
    x = torch.randn(8, 4)
    jm(x)
    jm.eval()
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)
    ok, reasons = reasons_mention(jm, "training")
    assert ok, reasons
    jm(x)
    assert counts(jm) == (2, 1)
    jm.train()
    torch.manual_seed(0)
    expected = m(x)
    torch.manual_seed(0)
    assert_close(jm(x), expected)
    assert counts(jm) == (2, 2)


def test_training_flag_set_on_original_module_is_seen():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9))
    jm = keraunos.jit(m)
    x = torch.randn(8, 4)
    jm(x)
    m.eval()
    assert_close(jm(x), m(x))


def test_replaced_parameter_is_used():
    m = nn.Linear(4, 3)
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    m.weight = nn.Parameter(torch.randn(3, 4))
    assert_close(jm(x), m(x))
    assert_close(jm(x), F.linear(x, m.weight, m.bias))


def test_replaced_parameter_through_wrapper_is_used():
    m = nn.Linear(4, 3)
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    jm.bias = nn.Parameter(torch.full((3,), 100.0))
    assert m.bias is jm.bias
    assert_close(jm(x), m(x))


def test_replaced_parameter_with_new_shape_recompiles():
    m = nn.Linear(4, 3)
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    m.weight = nn.Parameter(torch.randn(5, 4))
    m.bias = nn.Parameter(torch.randn(5))
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)
    ok, reasons = reasons_mention(jm, "weight")
    assert ok, reasons
    jm(x)
    assert counts(jm) == (2, 1)


def test_parameter_replaced_by_none_recompiles():
    m = nn.Linear(4, 3)
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    m.bias = None
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)


def test_changed_layernorm_eps_recompiles():
    m = nn.LayerNorm(4)
    jm = keraunos.jit(m)
    x = torch.randn(2, 4) * 1e-3
    jm(x)
    m.eps = 1.0
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)
    ok, reasons = reasons_mention(jm, "eps")
    assert ok, reasons
    jm(x)
    assert counts(jm) == (2, 1)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 0.5

    def forward(self, x):
        return self.lin(x) * self.scale


def test_changed_custom_float_attribute_recompiles():
    m = Scaled()
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    m.scale = 4.0
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)
    ok, reasons = reasons_mention(jm, "scale")
    assert ok, reasons
    jm(x)
    assert counts(jm) == (2, 1)


def test_changed_attribute_of_nested_submodule_recompiles():
    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.LeakyReLU(0.1)))
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    m[1][1].negative_slope = 0.5
    assert_close(jm(x), m(x))
    ok, reasons = reasons_mention(jm, "negative_slope")
    assert ok, reasons


def test_list_attribute_mutated_in_place_recompiles():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.dims = [0]

        def forward(self, x):
            return x.sum(self.dims)

    m = M()
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    jm(x)
    m.dims.append(1)
    assert_close(jm(x), m(x))


def test_list_attribute_replaced_recompiles():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.dims = [0]

        def forward(self, x):
            return x.sum(self.dims)

    m = M()
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    jm(x)
    m.dims = [0, 1]
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)


def test_replaced_submodule_recompiles():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    jm = keraunos.jit(m)
    x = torch.randn(2, 4)
    jm(x)
    m[1] = nn.Tanh()
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 0)


def test_config_object_attribute_change_is_seen():
    class Config:
        def __init__(self):
            self.use_bias = True

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()

        def forward(self, x):
            return x + 1 if self.config.use_bias else x - 1

    m = M()
    jm = keraunos.jit(m)
    x = torch.zeros(2)
    assert_close(jm(x), m(x))
    m.config.use_bias = False
    assert_close(jm(x), m(x))


# ------------------------------------------------------------------------------ cache modes
def test_same_input_mode_hits_on_same_metadata():
    f = lambda x, s: x * s  # noqa: E731
    jf = keraunos.jit(f, cache="same input")
    x = torch.randn(3)
    assert_close(jf(x, 2.0), f(x, 2.0))
    y = torch.randn(3)
    assert_close(jf(y, 2.0), f(y, 2.0))
    assert counts(jf) == (1, 1)


def test_same_input_mode_prologue_has_no_metadata_checks():
    jf = keraunos.jit(lambda x: x + 1, cache="same input")
    jf(torch.randn(3))
    source = str(keraunos.last_prologue_traces(jf)[-1])
    assert not [line for line in source.splitlines() if line.strip().startswith("if ")], source


def test_no_caching_mode_misses_every_call():
    f = lambda x: x.cos()  # noqa: E731
    jf = keraunos.jit(f, cache="no caching")
    x = torch.randn(3)
    for i in range(3):
        assert_close(jf(x), f(x))
    assert counts(jf) == (3, 0)


def test_cache_mode_enum_is_accepted():
    jf = keraunos.jit(lambda x: x + 1, cache=keraunos.CacheMode.NO_CACHING)
    jf(torch.randn(2))
    jf(torch.randn(2))
    assert counts(jf) == (2, 0)


def test_symbolic_values_mode_serves_two_sizes_with_one_entry():
    # (Was test_symbolic_values_mode_is_not_implemented; the mode exists now: tests/test_symbolic.py.)
    jf = keraunos.jit(lambda x: x * 2, cache="symbolic values")
    for n in (3, 4):
        x = torch.randn(n)
        torch.testing.assert_close(jf(x), x * 2)
    assert counts(jf) == (1, 1)


def test_invalid_cache_mode_raises_value_error():
    with pytest.raises(ValueError, match="cache"):
        keraunos.jit(lambda x: x, cache="sometimes")


def test_invalid_max_cache_entries_raises_value_error():
    with pytest.raises(ValueError, match="max_cache_entries"):
        keraunos.jit(lambda x: x, max_cache_entries=0)


def shape_dependent_program(x):
    return x.sum() * x.shape[0]


def test_cache_bound_warns_once_about_recompiling():
    jf = keraunos.jit(shape_dependent_program, max_cache_entries=2,
                      dynamic=False)  # every size an entry of its own
    with pytest.warns(UserWarning, match="shape_dependent_program.*recompiling") as record:
        for n in range(1, 6):
            x = torch.randn(n)
            assert_close(jf(x), shape_dependent_program(x))
    recompiling = [w for w in record if "recompiling" in str(w.message)]
    assert len(recompiling) == 1


def test_recompiling_warning_points_at_the_callers_line():
    jf = keraunos.jit(shape_dependent_program, max_cache_entries=1)
    with pytest.warns(UserWarning, match="recompiling") as record:
        jf(torch.randn(1))
        jf(torch.randn(2))
    assert record[0].filename == __file__


def test_cache_bound_keeps_at_most_max_entries():
    jf = keraunos.jit(shape_dependent_program, max_cache_entries=2,
                      dynamic=False)  # every size an entry of its own
    xs = [torch.randn(n) for n in range(1, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in xs:
            jf(x)
        assert counts(jf) == (4, 0)
        jf(xs[3])  # kept
        jf(xs[2])  # kept
        assert counts(jf) == (4, 2)
        assert_close(jf(xs[0]), shape_dependent_program(xs[0]))  # evicted: compiles again
        assert counts(jf) == (5, 2)
        jf(xs[1])  # evicted too
        assert counts(jf) == (6, 2)


def test_cache_bound_evicts_least_recently_used():
    jf = keraunos.jit(shape_dependent_program, max_cache_entries=2,
                      dynamic=False)  # every size an entry of its own
    a, b, c = torch.randn(1), torch.randn(2), torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jf(a)
        jf(b)
        jf(a)  # a is now the most recently used
        jf(c)  # evicts b
        assert counts(jf) == (3, 1)
        jf(a)
        assert counts(jf) == (3, 2)
        jf(b)
        assert counts(jf) == (4, 2)


def test_no_warning_within_cache_bound():
    jf = keraunos.jit(shape_dependent_program, max_cache_entries=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(1, 4):
            jf(torch.randn(n))


# ------------------------------------------------------------------------------ miss reasons
def test_miss_reasons_give_one_sentence_per_entry():
    jf = keraunos.jit(lambda x: x + 1, dynamic=False)  # every size an entry of its own
    jf(torch.randn(1))
    jf(torch.randn(2))
    jf(torch.randn(3))
    reasons = keraunos.last_cache_miss_reasons(jf)
    assert len(reasons) == 2
    assert all(isinstance(r, str) and "size mismatch" in r for r in reasons)


def test_miss_reasons_empty_before_any_recompile():
    jf = keraunos.jit(lambda x: x + 1)
    jf(torch.randn(1))
    assert keraunos.last_cache_miss_reasons(jf) == []


def test_counters_of_unjitted_callable_raise_type_error():
    with pytest.raises(TypeError):
        keraunos.cache_hits(lambda x: x)


def test_last_traces_before_first_call_raises():
    jf = keraunos.jit(lambda x: x)
    with pytest.raises(RuntimeError, match="not been called"):
        keraunos.last_traces(jf)


# ---------------------------------------------------------------------------------- threads
def test_threads_calling_jitted_function_concurrently_get_eager_results():
    f = lambda x, y: (x @ y).relu().sum(-1)  # noqa: E731
    jf = keraunos.jit(f, dynamic=False)  # every shape an entry of its own
    shapes = [(2, 3), (4, 3), (3, 3), (5, 3)]
    inputs = [(torch.randn(*s), torch.randn(3, 2)) for s in shapes for _ in range(2)]
    errors = []
    start = threading.Barrier(len(inputs))

    def work(x, y):
        try:
            start.wait()
            for _ in range(5):
                assert_close(jf(x, y), f(x, y))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=xy) for xy in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert keraunos.cache_misses(jf) == len(shapes)  # one compilation per shape, not per thread


def test_threads_calling_jitted_module_concurrently_get_eager_results():
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).eval()
    jm = keraunos.jit(m)
    inputs = [torch.randn(n, 4) for n in (1, 2, 3, 1, 2, 3)]
    errors = []
    start = threading.Barrier(len(inputs))

    def work(x):
        try:
            start.wait()
            for _ in range(5):
                with torch.no_grad():
                    assert_close(jm(x), m(x))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert type(m[0]) is nn.Linear
