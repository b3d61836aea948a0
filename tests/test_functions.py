"""Jitted functions give eager PyTorch's results: op coverage, random ops, grad, return values."""
import collections
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import keraunos


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def check(fn, *args, **kwargs):
    """Call ``fn`` eagerly and jitted (twice: a miss, then a hit) on copies of the inputs and
    compare the results and the inputs afterwards."""
    jf = keraunos.jit(fn)
    expected_args = _clone((args, kwargs))
    expected = fn(*expected_args[0], **expected_args[1])
    for call in range(2):
        actual_args = _clone((args, kwargs))
        actual = jf(*actual_args[0], **actual_args[1])
        assert_close(actual, expected)
        assert_close(actual_args, expected_args)
    assert keraunos.cache_misses(jf) == 1
    assert keraunos.cache_hits(jf) == 1
    return jf


# ------------------------------------------------------------------------- torch functions
def test_torch_functions():
    check(lambda x, y: torch.cat([torch.sin(x), torch.exp(y)], dim=1).sum(0), torch.randn(2, 3),
          torch.randn(2, 3))


def test_torch_matmul_and_softmax():
    check(lambda a, b: torch.softmax(torch.matmul(a, b), dim=-1), torch.randn(3, 4),
          torch.randn(4, 5))


def test_torch_where_and_comparisons():
    check(lambda x: torch.where(x > 0, x, torch.zeros_like(x)), torch.randn(4, 4))


def test_functional_ops():
    w, b = torch.randn(6, 4), torch.randn(6)

    def f(x, w, b):
        h = F.linear(x, w, b)
        h = F.gelu(h) + F.silu(h)
        h = F.layer_norm(h, (6,))
        return F.softmax(h, dim=-1), F.cross_entropy(h, torch.tensor([1, 2]))

    check(f, torch.randn(2, 4), w, b)


def test_functional_conv_and_pool():
    check(lambda x, w: F.max_pool2d(F.relu(F.conv2d(x, w, padding=1)), 2),
          torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3))


def test_scaled_dot_product_attention():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)


def test_scaled_dot_product_attention_with_mask():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, mask)


# ------------------------------------------------------------------ methods and operators
def test_tensor_methods():
    check(lambda x: x.sin().cos().mean(dim=-1, keepdim=True).float().abs().sqrt(),
          torch.randn(3, 4))


def test_binary_operators():
    check(lambda x, y: (x + y) * (x - y) / (y.abs() + 1) @ x.T % 3, torch.randn(3, 3),
          torch.randn(3, 3))


def test_reflected_operators():
    check(lambda x: (1 - x, 2 ** x, 3 / (x.abs() + 1), 2 * x, 5 + x), torch.randn(4))


def test_unary_operators_and_comparisons():
    check(lambda x: (-x, +x, abs(x), ~(x > 0), x <= 0.5, x == x), torch.randn(5))


def test_inplace_operator_on_intermediate():
    def f(x):
        y = x * 2
        y += 1
        y *= x
        return y

    check(f, torch.randn(4))


def test_inplace_operator_on_input_rebinding():
    def f(x, y):
        x += y
        return x * 2

    check(f, torch.randn(4), torch.randn(4))


def test_integer_and_bool_tensors():
    check(lambda a, b: ((a // 3) & b, a << 1, a.to(torch.float32) / 2),
          torch.arange(8), torch.full((8,), 5))


# ------------------------------------------------------------------------------ factories
def test_factory_functions():
    def f(x):
        return (torch.zeros(2, 3) + x, torch.arange(6).view(2, 3) * x, torch.ones_like(x),
                torch.full((2, 3), 7.0), torch.empty(2, 3).fill_(1.5), torch.eye(3))

    check(f, torch.randn(2, 3))


def test_factory_with_dtype_and_shape_from_input():
    check(lambda x: torch.zeros(x.shape[0], x.size(1) * 2, dtype=torch.int64) + torch.arange(
        x.shape[1] * 2), torch.randn(3, 2))


# ------------------------------------------------------------------- indexing and slicing
def test_index_with_int():
    check(lambda x: x[1], torch.randn(3, 4))


def test_index_with_slices():
    check(lambda x: (x[1:], x[:, ::2], x[-2:, 1:3]), torch.randn(4, 5))


def test_index_with_none_and_ellipsis():
    check(lambda x: (x[None], x[..., 0], x[:, None, ...], x[..., None, 1:]), torch.randn(2, 3, 4))


def test_index_with_tensor():
    check(lambda x, i: (x[i], x[:, i], x[i, 1:]), torch.randn(4, 4), torch.tensor([0, 2, 2]))


def test_index_with_bool_mask_tensor():
    mask = torch.tensor([True, False, True, False])
    check(lambda x, m: x[m] * 2, torch.randn(4, 3), mask)


def test_data_dependent_output_shapes_match_eager():
    f = lambda x: (torch.nonzero(x), x[x > 0].sum(), torch.where(x > 0)[0])  # noqa: E731
    jf = keraunos.jit(f)
    for x in (torch.tensor([1.0, 0.0, 2.0, -1.0]), torch.tensor([0.0, 0.0, 3.0, 4.0])):
        assert_close(jf(x), f(x))
    assert keraunos.cache_misses(jf) == 1


def test_index_with_list_of_ints():
    check(lambda x: x[[0, 2]] + x[:, [1, 1]].sum(), torch.randn(4, 3))


# ------------------------------------------------------------------------------------ views
def test_views():
    def f(x):
        return (x.view(4, 6), x.reshape(-1), x.transpose(0, 1), x.permute(2, 0, 1),
                x.unsqueeze(1), x[:, :1].expand(2, 5, 4), x.flatten(1), x.mT, x.contiguous())

    check(f, torch.randn(2, 3, 4))


def test_view_of_view_arithmetic():
    check(lambda x: x.view(2, 6).transpose(0, 1).reshape(3, 4).sum(0), torch.randn(12))


# ----------------------------------------------------------------------- tuple-returning ops
def test_split_and_chunk():
    def f(x):
        a, b, c = x.split(2, dim=0)
        d, e = torch.chunk(x, 2, dim=1)
        return a + b - c, d * e

    check(f, torch.randn(6, 4))


def test_max_with_dim_and_topk():
    def f(x):
        values, indices = torch.max(x, dim=1)
        top = x.topk(2, dim=-1)
        return values, indices, top.values, top.indices, torch.sort(x, dim=0)[0]

    check(f, torch.randn(3, 5))


def test_unbind():
    check(lambda x: sum(x.unbind(0)), torch.randn(3, 4))


def test_iteration_over_tensor_rows():
    def f(x):
        out = []
        for row in x:
            out.append(row * row.sum())
        return torch.stack(out)

    check(f, torch.randn(3, 4))


# -------------------------------------------------------------------- globals and closures
GLOBAL_WEIGHT = torch.randn(4, 4)


def _uses_global(x):
    return x @ GLOBAL_WEIGHT


def test_global_tensor_read_by_function():
    check(_uses_global, torch.randn(2, 4))


def test_closure_tensor_read_by_function():
    bias = torch.randn(4)

    def f(x):
        return x + bias

    check(f, torch.randn(2, 4))


def test_global_tensor_update_is_seen():
    global GLOBAL_WEIGHT
    jf = keraunos.jit(_uses_global)
    x = torch.randn(2, 4)
    assert_close(jf(x), _uses_global(x))
    saved = GLOBAL_WEIGHT
    try:
        GLOBAL_WEIGHT = torch.randn(4, 4)
        assert_close(jf(x), _uses_global(x))
    finally:
        GLOBAL_WEIGHT = saved


def test_closure_tensor_mutated_in_place_outside_is_seen():
    bias = torch.zeros(4)

    def f(x):
        return x + bias

    jf = keraunos.jit(f)
    x = torch.randn(4)
    assert_close(jf(x), x)
    bias.add_(3)
    assert_close(jf(x), x + 3)


def test_keyword_arguments():
    def f(x, *, scale=1.0, shift=None):
        return x * scale + (0 if shift is None else shift)

    check(f, torch.randn(3), scale=2.0, shift=torch.ones(3))


def test_default_arguments():
    def f(x, y=None, p=2):
        return x ** p if y is None else x + y

    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x), f(x))
    assert_close(jf(x, torch.ones(3)), f(x, torch.ones(3)))
    assert_close(jf(x, p=3), f(x, p=3))


def test_python_scalar_arguments():
    check(lambda x, a, b: x * a + b, torch.randn(3), 2.5, 3)


def test_container_arguments():
    def f(xs, d):
        return xs[0] + xs[1] * d["w"]

    check(f, [torch.randn(3), torch.randn(3)], {"w": torch.randn(3)})


def test_dtype_conversions():
    check(lambda x: (x.to(torch.float64), x.half().float(), x.type(torch.int32), x.bool()),
          torch.randn(4) * 10)


# ------------------------------------------------------------------------------ random ops
def _random_program(x):
    return x + torch.randn(3), torch.rand_like(x), F.dropout(x, p=0.5, training=True)


def test_random_ops_match_eager_under_manual_seed_first_call():
    x = torch.randn(3)
    jf = keraunos.jit(_random_program)
    torch.manual_seed(1234)
    expected = _random_program(x)
    torch.manual_seed(1234)
    actual = jf(x)
    assert_close(actual, expected)


def test_random_ops_match_eager_under_manual_seed_on_cache_hit():
    x = torch.randn(3)
    jf = keraunos.jit(_random_program)
    jf(x)
    torch.manual_seed(99)
    expected = _random_program(x)
    torch.manual_seed(99)
    actual = jf(x)
    assert keraunos.cache_hits(jf) == 1
    assert_close(actual, expected)


def test_rng_state_after_call_matches_eager():
    x = torch.randn(3)
    jf = keraunos.jit(_random_program)
    for _ in range(2):  # miss, then hit
        torch.manual_seed(7)
        _random_program(x)
        expected_state = torch.get_rng_state()
        expected_next = torch.rand(4)
        torch.manual_seed(7)
        jf(x)
        assert torch.equal(torch.get_rng_state(), expected_state)
        assert_close(torch.rand(4), expected_next)


def test_consecutive_random_calls_give_new_values_like_eager():
    x = torch.randn(8)
    f = lambda x: x + torch.randn(8)  # noqa: E731
    jf = keraunos.jit(f)
    torch.manual_seed(3)
    expected = [f(x) for _ in range(3)]
    torch.manual_seed(3)
    actual = [jf(x) for _ in range(3)]
    assert_close(actual, expected)
    assert not torch.equal(actual[0], actual[1])


def test_unused_random_op_still_advances_generator():
    def f(x):
        torch.rand(5)  # unused, but eager draws from the generator
        return x + torch.rand(2)

    x = torch.zeros(2)
    jf = keraunos.jit(f)
    torch.manual_seed(5)
    expected = f(x)
    torch.manual_seed(5)
    assert_close(jf(x), expected)


# -------------------------------------------------------------------------------------- grad
def test_backward_through_jitted_output_matches_eager_grads():
    def f(x, w):
        return (torch.tanh(x @ w) ** 2).sum()

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    f(x, w).backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    jf = keraunos.jit(f)
    jf(x, w).backward()
    assert_close((x.grad, w.grad), expected)


def test_backward_on_cache_hit_matches_eager_grads():
    f = lambda x: (x.sin() * x).mean()  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(5, requires_grad=True)
    jf(x).backward()
    x.grad = None
    jf(x).backward()
    assert keraunos.cache_hits(jf) == 1
    assert_close(x.grad, x.detach().cos() * x.detach() / 5 + x.detach().sin() / 5)


def test_output_requires_grad_like_eager():
    jf = keraunos.jit(lambda x, y: x * y)
    out = jf(torch.randn(3, requires_grad=True), torch.randn(3))
    assert out.requires_grad and out.grad_fn is not None
    out = jf(torch.randn(3), torch.randn(3))
    assert not out.requires_grad


def test_no_grad_inside_function_body():
    def f(x):
        with torch.no_grad():
            y = x * 2
        return y + x, y

    x = torch.randn(3, requires_grad=True)
    jf = keraunos.jit(f)
    out, y = jf(x)
    e_out, e_y = f(x)
    assert_close(out, e_out)
    assert y.requires_grad is e_y.requires_grad is False
    assert torch.is_grad_enabled()
    out.sum().backward()
    assert_close(x.grad, torch.ones(3))


def test_no_grad_around_jitted_call():
    jf = keraunos.jit(lambda x: x * 2)
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = jf(x)
    assert not out.requires_grad
    out = jf(x)
    assert out.requires_grad


# -------------------------------------------------------------------------- return values
def test_return_tuple():
    check(lambda x: (x + 1, x * 2), torch.randn(3))


def test_return_list():
    check(lambda x: [x + 1, x * 2], torch.randn(3))


def test_return_dict():
    out = check(lambda x: {"a": x + 1, "b": x * 2}, torch.randn(3))(torch.randn(3))
    assert type(out) is dict and list(out) == ["a", "b"]


def test_return_nested_structure():
    def f(x):
        return {"pair": (x, [x + 1, {"deep": x * 3}]), "n": 3, "s": "ok", "none": None}

    jf = keraunos.jit(f)
    x = torch.randn(3)
    out = jf(x)
    expected = f(x)
    assert_close(out["pair"], expected["pair"])
    assert type(out["pair"]) is tuple and type(out["pair"][1]) is list
    assert out["n"] == 3 and out["s"] == "ok" and out["none"] is None


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_return_dataclass():
    jf = keraunos.jit(lambda x: Output(x * 2, x.sum()))
    x = torch.randn(3)
    out = jf(x)
    assert type(out) is Output
    assert_close(out.logits, x * 2)
    assert_close(out.loss, x.sum())


Pair = collections.namedtuple("Pair", ["first", "second"])


def test_return_namedtuple():
    jf = keraunos.jit(lambda x: Pair(x + 1, x - 1))
    x = torch.randn(3)
    out = jf(x)
    assert type(out) is Pair
    assert_close(out.first, x + 1)
    assert_close(out.second, x - 1)


def test_return_none():
    jf = keraunos.jit(lambda x: None)
    assert jf(torch.randn(3)) is None


def test_return_python_scalars():
    jf = keraunos.jit(lambda x: (x.shape[0], x.dim() * 1.5, True))
    assert jf(torch.randn(4, 2)) == (4, 3.0, True)
    assert jf(torch.randn(5, 2)) == (5, 3.0, True)


def test_return_input_unchanged_preserves_identity():
    jf = keraunos.jit(lambda x, y: (x, y + 1))
    x, y = torch.randn(3), torch.randn(3)
    for _ in range(2):
        out = jf(x, y)
        assert out[0] is x
        assert_close(out[1], y + 1)


def test_returns_are_fresh_tensors_each_call():
    jf = keraunos.jit(lambda x: x * 2)
    x = torch.randn(3)
    a = jf(x)
    b = jf(x)
    assert a is not b
    a.add_(100)
    assert_close(b, x * 2)


def test_return_view_of_input_shares_memory_like_eager():
    jf = keraunos.jit(lambda x: x[1:])
    x = torch.randn(4)
    out = jf(x)
    out.add_(1)  # eager: writes through to x
    assert_close(x[1:], out)


# ------------------------------------------------------------------ known bugs (strict xfail)
SCALE = 2.0


def _uses_global_scalar(x):
    return x * SCALE


def test_global_python_scalar_change_is_seen():
    global SCALE
    jf = keraunos.jit(_uses_global_scalar)
    x = torch.ones(2)
    jf(x)
    saved = SCALE
    try:
        SCALE = 3.0
        assert_close(jf(x), _uses_global_scalar(x))
    finally:
        SCALE = saved


def test_closure_python_scalar_change_is_seen():
    s = 2.0

    def f(x):
        return x * s

    jf = keraunos.jit(f)
    x = torch.ones(2)
    jf(x)
    s = 3.0
    assert_close(jf(x), f(x))


def test_autocast_inside_function_body_matches_eager():
    def f(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    out, expected = keraunos.jit(f)(a, b), f(a, b)
    assert out.dtype == expected.dtype
    assert_close(out, expected)


def test_autocast_around_jitted_call_matches_eager():
    f = lambda a, b: a @ b  # noqa: E731
    jf = keraunos.jit(f)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    jf(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = jf(a, b), f(a, b)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_close(out, expected)


def test_function_without_tensor_inputs():
    f = lambda n: torch.arange(n) * 2  # noqa: E731
    assert_close(keraunos.jit(f)(3), f(3))


def test_list_argument_mutated_by_program_like_eager():
    def f(xs):
        xs.append(xs[0] * 2)
        return xs[-1]

    xs = [torch.ones(2)]
    out = keraunos.jit(f)(xs)
    assert len(xs) == 2
    assert_close(xs[1], out)


def test_plain_list_and_dict_arguments_the_program_changes_are_changed_as_in_eager():
    """An empty list (or one of plain values) is a container too: the program appends to a
    stand-in and the epilogue replays it; capture never touches the caller's list (it used to
    append a fake tensor to it, and the prologue then compared real with fake)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def f(x, xs, d):
        xs.append(x)
        xs.append(len(xs))
        d["y"] = x * 2
        return x.sin()
    jf = keraunos.jit(f)
    for start in ([], [1, 2], []):  # the third call is a cache hit on the first's entry
        x = torch.randn(3)
        mine, theirs, mine_d, theirs_d = list(start), list(start), {}, {}
        assert_close(jf(x, mine, mine_d), f(x, theirs, theirs_d))
        assert mine[:-2] == theirs[:-2] and mine[-2] is x and mine[-1] == theirs[-1]
        assert list(mine_d) == ["y"] and not isinstance(mine_d["y"], FakeTensor)
        assert_close(mine_d["y"], theirs_d["y"])
    assert keraunos.cache_hits(jf) == 1


def test_jitted_function_called_inside_jitted_function():
    inner = keraunos.jit(lambda x: x.sin())
    outer = keraunos.jit(lambda x: inner(x) + 1)
    x = torch.randn(3)
    assert_close(outer(x), x.sin() + 1)


def test_call_under_inference_mode():
    jf = keraunos.jit(lambda x: x * 2)
    with torch.inference_mode():
        x = torch.ones(2)
        out = jf(x)
    assert_close(out, torch.full((2,), 2.0))


def test_vmap_with_a_constant_made_inside_the_vmapped_function():
    """transformers' Falcon masks with `lambda *args: torch.tensor(True)` under torch.vmap: the
    constant is made again by the trace, as written, and is no input."""
    def f(x):
        scaled = torch.vmap(lambda row: row * torch.tensor(2.0))(x)
        return torch.vmap(lambda row: row & torch.tensor(True))(scaled > 0)

    jf = keraunos.jit(f)
    for seed in (0, 1):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        assert_close(jf(x), f(x))
    assert keraunos.cache_hits(jf) == 1
    assert "torch.tensor(2.0" in str(keraunos.last_traces(jf)[-1])


@torch.jit.script
def _log_buckets(relative, mid: int):
    """DeBERTa-v2's shape of helper: a TorchScript function of tensors and ints."""
    sign = torch.sign(relative)
    far = torch.where(relative.abs() < mid, torch.tensor(mid - 1).type_as(relative),
                      relative.abs())
    return torch.ceil(torch.log(far / mid) * (mid - 1)) * sign + mid


def test_a_torch_jit_script_function_is_captured_from_the_python_it_was_made_from():
    """The TorchScript interpreter cannot run on capture's fake tensors; capture runs the Python
    function ``torch.jit.script`` was given instead, so its ops are the trace's own lines (and
    have a backward), and the scripted function still runs in TorchScript outside capture."""
    def f(x, w):
        return (_log_buckets(x, 4) * w).sum(-1)

    x = torch.arange(-8.0, 8.0).reshape(2, 8)
    w = torch.randn(8, requires_grad=True)
    jf = keraunos.jit(f)
    w_ref = w.detach().clone().requires_grad_()
    out, ref = jf(x, w), f(x, w_ref)
    assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert_close(w.grad, w_ref.grad)
    trace = str(keraunos.last_traces(jf)[-1])
    assert "sign" in trace and "ceil" in trace
    assert keraunos.last_backward_traces(jf)
    assert isinstance(_log_buckets, torch.jit.ScriptFunction)
    from keraunos.capture import interceptors  # TorchScript's own call, given back after capture
    assert vars(torch.jit.ScriptFunction)["__call__"] is interceptors._script_call_original


class _HoldsTorchScript(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                             torch.nn.ReLU()))
        self.traced = torch.jit.trace(torch.nn.Linear(4, 4), torch.randn(2, 4))

    def forward(self, x):
        return self.traced(self.scripted(x)).sum(-1)


def test_a_torchscript_module_in_the_tree_takes_the_fallback_route_or_is_refused():
    """A scripted or traced module keeps no Python forward to capture: the default falls back
    to torch.compile(backend="keraunos") with one warning naming it; fallback="error" raises a
    CaptureError naming it, and leaves the module as it was."""
    from keraunos.errors import TorchScriptModuleError
    model = _HoldsTorchScript()
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"module\.scripted: it is a TorchScript module"):
        out = keraunos.jit(model)(x)
    assert_close(out, model(x))
    with pytest.raises(TorchScriptModuleError, match="What to do"):
        keraunos.jit(model, fallback="error")(x)
    assert isinstance(model.scripted, torch.jit.ScriptModule)
    assert_close(model(x), out)
