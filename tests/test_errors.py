"""Errors: what cannot be captured says where and why; user errors raise what eager raises; after
any error the jitted callable and the module still work."""
import os

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import keraunos

THIS_FILE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    """The line number in this file of the line containing ``marker``."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of(" not in line:
                return i
    raise AssertionError(marker)


def assert_capture_error(fn, args, marker, *op_words):
    with pytest.raises(keraunos.CaptureError) as info:
        fn(*args)
    message = str(info.value)
    assert f"{THIS_FILE}:{line_of(marker)}" in message, message
    for w in op_words:
        assert w in message, message
    return message


# ------------------------------------------------------------------ data-dependent programs
def branch_on_data(x):
    if x.sum() > 0:  # MARK-branch
        return x
    return -x


def test_control_flow_on_tensor_data_raises_capture_error():
    assert_capture_error(keraunos.jit(branch_on_data, fallback="error"), (torch.randn(3),), "MARK-branch",
                         "x.sum() > 0", "bool")


def use_item(x):
    return x * x.item()  # MARK-item


def test_item_raises_capture_error():
    assert_capture_error(keraunos.jit(use_item, fallback="error"), (torch.randn(1),), "MARK-item", "item")


def use_tolist(x):
    values = x.tolist()  # MARK-tolist
    return x * len(values)


def test_tolist_raises_capture_error():
    assert_capture_error(keraunos.jit(use_tolist, fallback="error"), (torch.randn(3),), "MARK-tolist", "tolist")


def use_nonzero_size(x):
    n = torch.nonzero(x).shape[0]
    return x * n  # MARK-nonzero-size


def test_data_dependent_size_used_as_python_number_raises_capture_error():
    assert_capture_error(keraunos.jit(use_nonzero_size, fallback="error"), (torch.randn(3),), "MARK-nonzero-size",
                         "x * n")


def use_mask_length(x):
    if len(x[x > 0]) > 1:  # MARK-mask-len
        return x
    return -x


def test_branch_on_data_dependent_size_raises_capture_error():
    assert_capture_error(keraunos.jit(use_mask_length, fallback="error"), (torch.randn(3),), "MARK-mask-len",
                         "len(x[x > 0])")


def use_int(x):
    return torch.zeros(int(x.sum()))  # MARK-int


def test_int_of_tensor_raises_capture_error():
    assert_capture_error(keraunos.jit(use_int, fallback="error"), (torch.ones(3),), "MARK-int", "int")


class BranchingModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, check=False):
        y = self.lin(x)
        if check and y.max() > 100:  # MARK-module-branch
            raise ValueError("too large")
        return y


def test_capture_error_in_module_names_the_module_source_line():
    m = BranchingModule()
    assert_capture_error(keraunos.jit(m, fallback="error"), (torch.randn(2, 3), True), "MARK-module-branch")


def test_capture_error_is_a_keraunos_error():
    assert issubclass(keraunos.CaptureError, keraunos.KeraunosError)
    with pytest.raises(keraunos.KeraunosError):
        keraunos.jit(use_item, fallback="error")(torch.randn(1))


# ------------------------------------------------------------------------- unsupported input
def test_unsupported_input_type_raises_unsupported_input_error():
    jf = keraunos.jit(lambda x, o: x)
    with pytest.raises(keraunos.UnsupportedInputError) as info:
        jf(torch.randn(2), object())
    assert isinstance(info.value, TypeError)
    assert "args[1]" in str(info.value)


def test_unsupported_input_in_kwargs_raises_unsupported_input_error():
    jf = keraunos.jit(lambda x, **kw: x)
    with pytest.raises(TypeError):
        jf(torch.randn(2), thing=object())


def test_unsupported_input_to_module_raises_unsupported_input_error():
    m = BranchingModule()
    jm = keraunos.jit(m)
    with pytest.raises(keraunos.UnsupportedInputError):
        jm(torch.randn(2, 3), object())
    assert type(m) is BranchingModule


def test_jit_of_non_callable_raises_type_error():
    with pytest.raises(TypeError):
        keraunos.jit(42)


def test_jit_of_jitted_callable_raises_type_error():
    with pytest.raises(TypeError):
        keraunos.jit(keraunos.jit(lambda x: x))


def test_invalid_transform_raises_type_error():
    with pytest.raises(TypeError):
        keraunos.jit(lambda x: x, transforms=[object()])


# -------------------------------------------------------------------- user errors, as eager
def test_matmul_shape_mismatch_raises_like_eager():
    f = lambda a, b: a @ b  # noqa: E731
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    with pytest.raises(Exception) as eager:
        f(a, b)
    with pytest.raises(Exception) as jitted:
        keraunos.jit(f)(a, b)
    assert type(jitted.value) is type(eager.value)


def assert_raises_like_eager(f, *args):
    with pytest.raises(Exception) as eager:
        f(*args)
    with pytest.raises(Exception) as jitted:
        keraunos.jit(f)(*args)
    assert type(jitted.value) is type(eager.value), (jitted.value, eager.value)
    assert str(eager.value) in str(jitted.value)
    return jitted.value


def test_impossible_view_raises_eagers_runtime_error_not_the_fake_kernels_value_error():
    # The fake kernel raises ValueError here; eager (and so the user's `except`) sees RuntimeError.
    error = assert_raises_like_eager(lambda a: a.view(-1), torch.randn(4).expand(3, 4))
    assert "view" in "".join(getattr(error, "__notes__", [])), "the note names the op"
    assert_raises_like_eager(lambda a: a.t().view(-1), torch.randn(3, 4))


def test_impossible_view_after_other_ops_raises_like_eager():
    assert_raises_like_eager(lambda a, b: (a * b).t().view(6), torch.randn(2, 3), torch.randn(3))


def test_broadcast_mismatch_raises_like_eager():
    f = lambda a, b: a + b  # noqa: E731
    a, b = torch.randn(3), torch.randn(4)
    with pytest.raises(RuntimeError):
        f(a, b)
    with pytest.raises(RuntimeError):
        keraunos.jit(f)(a, b)


def test_index_out_of_range_raises_like_eager():
    f = lambda x: x[5]  # noqa: E731
    with pytest.raises(IndexError):
        f(torch.randn(3))
    with pytest.raises(IndexError):
        keraunos.jit(f)(torch.randn(3))


def test_python_exception_in_program_propagates():
    def f(x, n):
        if n < 0:
            raise ValueError("n must be non-negative")
        return x * n

    with pytest.raises(ValueError, match="non-negative"):
        keraunos.jit(f)(torch.randn(2), -1)


def test_wrong_number_of_arguments_raises_type_error_like_eager():
    f = lambda x, y: x + y  # noqa: E731
    with pytest.raises(TypeError):
        f(torch.randn(2))
    with pytest.raises(TypeError):
        keraunos.jit(f)(torch.randn(2))


def test_linear_shape_mismatch_in_module_raises_like_eager():
    m = nn.Linear(4, 2)
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 5))
    with pytest.raises(RuntimeError):
        keraunos.jit(m)(torch.randn(2, 5))


# -------------------------------------------------------------------- recovering after errors
def test_jitted_function_works_after_capture_error():
    def f(x, branch):
        if branch and x.sum() > 0:
            return x
        return x * 2

    jf = keraunos.jit(f, fallback="error")
    with pytest.raises(keraunos.CaptureError):
        jf(torch.randn(3), True)
    x = torch.randn(3)
    assert_close(jf(x, False), x * 2)
    assert_close(jf(x, False), x * 2)
    assert keraunos.cache_hits(jf) == 1


def test_jitted_function_works_after_user_error():
    f = lambda a, b: a @ b  # noqa: E731
    jf = keraunos.jit(f)
    with pytest.raises(RuntimeError):
        jf(torch.randn(3, 2), torch.randn(3, 2))
    a, b = torch.randn(3, 2), torch.randn(2, 4)
    assert_close(jf(a, b), a @ b)


def test_jitted_function_works_after_error_on_a_later_call():
    f = lambda a, b: a @ b  # noqa: E731
    jf = keraunos.jit(f)
    a, b = torch.randn(3, 2), torch.randn(2, 4)
    assert_close(jf(a, b), a @ b)
    with pytest.raises(RuntimeError):
        jf(torch.randn(3, 2), torch.randn(3, 4))
    assert_close(jf(a, b), a @ b)
    assert keraunos.cache_hits(jf) == 1


def test_jitted_function_works_after_unsupported_input():
    jf = keraunos.jit(lambda x, o=None: x + 1)
    with pytest.raises(keraunos.UnsupportedInputError):
        jf(torch.zeros(2), object())
    assert_close(jf(torch.zeros(2)), torch.ones(2))


def test_module_class_restored_after_capture_error():
    m = BranchingModule()
    jm = keraunos.jit(m, fallback="error")
    with pytest.raises(keraunos.CaptureError):
        jm(torch.randn(2, 3), True)
    assert type(m) is BranchingModule
    assert type(m.lin) is nn.Linear
    x = torch.randn(2, 3)
    assert_close(jm(x), m(x))


def test_module_class_restored_after_user_error():
    m = nn.Sequential(nn.Linear(4, 2), nn.ReLU())
    jm = keraunos.jit(m)
    with pytest.raises(RuntimeError):
        jm(torch.randn(2, 5))
    assert type(m) is nn.Sequential
    assert [type(c) for c in m] == [nn.Linear, nn.ReLU]
    x = torch.randn(2, 4)
    assert_close(jm(x), m(x))


def test_module_state_unchanged_after_error_in_forward():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            self.count.add_(1)
            return x @ torch.ones(4, 4)

    m = M()
    jm = keraunos.jit(m)
    with pytest.raises(RuntimeError):
        jm(torch.randn(2, 5))
    assert type(m) is M
    assert m.calls == 0
    assert_close(m.count, torch.zeros(1))
    jm(torch.randn(2, 4))
    assert m.calls == 1
    assert_close(m.count, torch.ones(1))


def test_writing_an_object_to_a_module_in_forward_raises_capture_error():
    class M(nn.Module):
        def forward(self, x):
            self.helper = object()  # MARK-setattr-object
            return x

    m = M()
    jm = keraunos.jit(m)
    with pytest.raises(keraunos.CaptureError) as info:
        jm(torch.randn(2))
    assert "helper" in str(info.value)
    assert type(m) is M
    assert not hasattr(m, "helper")


def test_grad_mode_restored_after_error_inside_no_grad_block():
    def f(x):
        with torch.no_grad():
            return x @ torch.ones(5, 5)

    jf = keraunos.jit(f)
    with pytest.raises(RuntimeError):
        jf(torch.randn(2, 4))
    assert torch.is_grad_enabled()


def test_matmul_of_float_and_double_raises_like_eager_even_when_unused():
    # The meta kernel accepts float @ double; the real one raises, and eager raises even though
    # the result is never used (a dead line the compiler would otherwise drop).
    def f(a, b):
        unused = a @ b.double()  # noqa: F841
        return a + 1
    assert_raises_like_eager(f, torch.randn(3, 3), torch.randn(3, 3))


def test_mixed_float_dtypes_that_eager_accepts_still_compile():
    f = lambda a, b: (a * b.double()).sum() + torch.where(a > 0, a, b.half()).sum()  # noqa: E731
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    assert_close(keraunos.jit(f)(a, b), f(a, b))


def test_in_place_mixed_dtype_write_to_a_view_of_a_leaf_clone_compiles():
    # The real-kernel check of a mixed-dtype call ran on zeros that were leaves requiring grad,
    # so an in-place op raised autograd's leaf error, which eager does not raise here.
    def f(a):
        a.addcmul_(a.mean(0).double(), a.mean(0).double(), value=0.5)
        a[0] = a.mean(0) * a.double().mean(0)
        return a * 2

    results = []
    for fn in (f, keraunos.jit(f)):
        torch.manual_seed(0)
        leaf = torch.randn(3, 4, requires_grad=True)
        out = fn(leaf.clone())
        out.sum().backward()
        results.append((out, leaf.grad))
    assert_close(results[1][0], results[0][0])
    assert_close(results[1][1], results[0][1])


def test_subtracting_a_bool_raises_like_eager_even_when_unused():
    def f(a, s):
        unused = (a.sum() - s).detach()  # noqa: F841
        return a * 2
    assert_raises_like_eager(f, torch.randn(2, 4), True)
    assert_raises_like_eager(lambda m: -m, torch.ones(3, dtype=torch.bool))
    g = lambda a, m: (a - 1.5) * m  # noqa: E731  (a bool elsewhere in the line is fine)
    a, m = torch.randn(3), torch.tensor([True, False, True])
    assert_close(keraunos.jit(g)(a, m), g(a, m))


def test_data_dependent_decision_raises_data_dependent_error_naming_the_backend_route():
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x
    with pytest.raises(keraunos.DataDependentError) as info:
        keraunos.jit(f, fallback="error")(torch.randn(3))
    assert isinstance(info.value, keraunos.CaptureError)
    assert 'torch.compile(model, backend="keraunos")' in str(info.value)
