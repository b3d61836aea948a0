"""What keraunos.jit does with programs it cannot capture as one trace: by default it falls back to
torch.compile(backend="keraunos") with one warning; fallback="error" raises. torch.func transforms
inside a jitted function fall back the same way; applied to one, it runs eagerly."""
import warnings

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.errors import DataDependentError, FunctionTransformError
from helpers import run_with_store


def _branchy(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


def test_data_dependent_program_runs_by_default_with_one_warning():
    jitted = keraunos.jit(_branchy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sign in (1, -1, 1):
            x = torch.ones(3) * sign
            assert_close(jitted(x), _branchy(x))
    fallbacks = [w for w in caught if "falls back to torch.compile" in str(w.message)]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "if x.sum() > 0" in message and "one trace" in message
    assert 'fallback="error"' in message


def test_fallback_error_raises_the_data_dependent_error():
    with pytest.raises(DataDependentError, match="if x.sum"):
        keraunos.jit(_branchy, fallback="error")(torch.ones(3))


def test_a_tensor_used_as_a_size_is_named_so():
    def f(x, n):
        return x[: n.argmax()]

    with pytest.raises(DataDependentError, match="used as a size"):
        keraunos.jit(f, fallback="error")(torch.arange(5.0), torch.tensor([0, 3, 1]))
    x, n = torch.arange(5.0), torch.tensor([0, 3, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close(keraunos.jit(f)(x, n), f(x, n))


def _top_of_the_kept(scores, keep):
    kept = scores[:, keep]  # a width that depends on the mask's data
    return kept.topk(kept.shape[-1] // 2, dim=-1).values * 2


FALLBACK_AND_DISTRIBUTIONS = """
import json, warnings, torch, keraunos
warnings.simplefilter("ignore")
def f(x):
    if x.sum() > 0:  # a decision on data: the torch.compile route
        return x * 2
    return x - 1
jitted = keraunos.jit(f)
results = [jitted(torch.ones(3)).tolist(), jitted(-torch.ones(3)).tolist()]
try:
    torch.distributions.Normal(torch.zeros(1), -torch.ones(1))
    validated = False
except ValueError:
    validated = True
print(json.dumps([keraunos.dynamo.last_traces(jitted) != [], results, validated]))
"""


def test_a_fallback_leaves_the_validation_of_distributions_on(tmp_path):
    """Dynamo's first use in a process turns torch.distributions' argument checks off for good;
    a program that fell back to it must leave them as the user had them (a fresh process: the
    suite's own torch.compile calls turned them off here)."""
    script = tmp_path / "fallback.py"
    script.write_text(FALLBACK_AND_DISTRIBUTIONS)
    fell_back, results, validated = run_with_store(script, [], tmp_path / "store")
    assert fell_back and results == [[2.0, 2.0, 2.0], [-2.0, -2.0, -2.0]]
    assert validated


def test_a_size_from_boolean_indexing_falls_back_and_matches_eager():
    scores = torch.randn(3, 8)
    keep = torch.tensor([True, False, True, True, False, True, True, False])
    with pytest.raises(DataDependentError, match="topk"):
        keraunos.jit(_top_of_the_kept, fallback="error")(scores, keep)
    jitted = keraunos.jit(_top_of_the_kept)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mask in (keep, ~keep, torch.ones(8, dtype=torch.bool)):
            assert_close(jitted(scores, mask), _top_of_the_kept(scores, mask))
    assert sum("falls back to torch.compile" in str(w.message) for w in caught) == 1


def _loss(w, x):
    return (x @ w).sin().sum()


def _inputs():
    torch.manual_seed(0)
    return torch.randn(3, 2), torch.randn(4, 3)


TRANSFORMS_INSIDE = {
    "grad": lambda w, x: torch.func.grad(_loss)(w, x),
    "grad_and_value": lambda w, x: torch.func.grad_and_value(_loss)(w, x)[0],
    "jacrev": lambda w, x: torch.func.jacrev(lambda w: (x @ w).tanh())(w),
    "vjp": lambda w, x: torch.func.vjp(lambda w: (x @ w).cos(), w)[1](torch.ones(4, 2))[0],
    "jvp": lambda w, x: torch.func.jvp(lambda w: (x @ w).cos(), (w,), (torch.ones_like(w),))[1],
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS_INSIDE))
def test_a_torch_func_transform_inside_falls_back_and_matches_eager(name):
    fn = TRANSFORMS_INSIDE[name]
    w, x = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close(keraunos.jit(fn)(w, x), fn(w, x))
    with pytest.raises(FunctionTransformError, match="torch.func"):
        keraunos.jit(fn, fallback="error")(w, x)


TRANSFORMS_OUTSIDE = {
    "grad": lambda f, w, x: torch.func.grad(f)(w, x),
    "vmap": lambda f, w, x: torch.func.vmap(f, in_dims=(None, 0))(w, x),
    "jacrev": lambda f, w, x: torch.func.jacrev(f)(w, x),
    "jvp": lambda f, w, x: torch.func.jvp(lambda w: f(w, x), (w,), (torch.ones_like(w),))[1],
    "vjp": lambda f, w, x: torch.func.vjp(lambda w: f(w, x), w)[1](torch.tensor(1.0))[0],
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS_OUTSIDE))
def test_a_torch_func_transform_of_a_jitted_function_matches_eager(name):
    apply = TRANSFORMS_OUTSIDE[name]
    w, x = _inputs()
    jitted = keraunos.jit(_loss)
    assert_close(jitted(w, x), _loss(w, x))  # an entry exists: its prologue must refuse wrappers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_close(apply(jitted, w, x), apply(_loss, w, x))
        apply(jitted, w, x)
    assert len([w for w in caught if "torch.func transform" in str(w.message)]) == 1
    assert keraunos.cache_misses(jitted) == 1  # nothing was compiled for the wrapped calls
