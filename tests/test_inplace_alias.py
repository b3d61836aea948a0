"""In-place writes, the epilogue's side effects, and inputs that share memory: as eager does."""
import copy
import weakref

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import keraunos


def run_both(f, *args):
    """``f`` eagerly and jitted on separate copies of ``args``; returns both (out, args) pairs."""
    eager_args = copy.deepcopy(args)
    jit_args = copy.deepcopy(args)
    jf = keraunos.jit(f)
    return jf, (f(*eager_args), eager_args), (jf(*jit_args), jit_args)


# --------------------------------------------------------------------------- in-place on inputs
def test_inplace_add_on_input_updates_it_like_eager():
    def f(x):
        x.add_(1)
        return x * 2

    x = torch.randn(3)
    expected_x = x + 1
    jf = keraunos.jit(f)
    out = jf(x)
    assert_close(x, expected_x)
    assert_close(out, expected_x * 2)
    out = jf(x)  # cache hit writes again
    assert keraunos.cache_hits(jf) == 1
    assert_close(x, expected_x + 1)
    assert_close(out, (expected_x + 1) * 2)


def test_inplace_op_returning_input_returns_the_same_object():
    f = lambda x: x.add_(1)  # noqa: E731
    jf = keraunos.jit(f)
    for _ in range(2):
        x = torch.zeros(3)
        out = jf(x)
        assert out is x
        assert_close(x, torch.ones(3))


def test_returning_input_after_inplace_op_returns_the_same_object():
    def f(x, y):
        x.mul_(y)
        return x, y

    jf = keraunos.jit(f)
    x, y = torch.randn(3), torch.randn(3)
    expected = x * y
    out = jf(x, y)
    assert out[0] is x and out[1] is y
    assert_close(x, expected)


def test_inplace_operator_on_input_updates_it_like_eager():
    def f(x, y):
        x += y
        x *= 2
        return x

    x, y = torch.randn(3), torch.randn(3)
    expected = (x + y) * 2
    out = keraunos.jit(f)(x, y)
    assert out is x
    assert_close(x, expected)


def test_input_version_counter_advances_like_eager():
    jf = keraunos.jit(lambda x: x.add_(1))
    x = torch.zeros(3)
    v = x._version
    jf(x)
    assert x._version > v


def test_setitem_on_input():
    def f(x):
        x[0] = 5
        x[1:, 1] = torch.tensor(-1.0)
        return x.sum()

    jf, (e_out, (e_x,)), (out, (x,)) = run_both(f, torch.randn(3, 3))
    assert_close(x, e_x)
    assert_close(out, e_out)


def test_setitem_with_tensor_index_on_input():
    def f(x, idx, v):
        x[idx] = v
        return x

    x = torch.zeros(5)
    idx, v = torch.tensor([1, 3]), torch.tensor([7.0, 8.0])
    out = keraunos.jit(f)(x, idx, v)
    assert out is x
    assert_close(x, torch.tensor([0.0, 7.0, 0.0, 8.0, 0.0]))


def test_mutation_of_view_of_input():
    def f(x):
        x[1:].mul_(2)
        return x + 0

    jf, (e_out, (e_x,)), (out, (x,)) = run_both(f, torch.randn(4, 2))
    assert_close(x, e_x)
    assert_close(out, e_out)


def test_mutation_of_transposed_view_of_input():
    def f(x):
        x.t()[0].fill_(3.0)
        return x

    x = torch.randn(3, 2)
    expected = x.clone()
    expected[:, 0] = 3.0
    out = keraunos.jit(f)(x)
    assert out is x
    assert_close(x, expected)


def test_mutation_of_noncontiguous_input():
    def f(x):
        x.add_(1)
        return x.sum()

    base = torch.zeros(4, 4)
    view = base[:, 1]
    out = keraunos.jit(f)(view)
    assert_close(out, torch.tensor(4.0))
    expected = torch.zeros(4, 4)
    expected[:, 1] = 1
    assert_close(base, expected)


def test_read_after_inplace_write_sees_new_value():
    def f(x):
        before = x * 1
        x.add_(10)
        return before, x * 1

    x = torch.zeros(2)
    before, after = keraunos.jit(f)(x)
    assert_close(before, torch.zeros(2))
    assert_close(after, torch.full((2,), 10.0))


def test_returned_view_of_mutated_input_is_a_view_of_it():
    def f(x):
        x.add_(1)
        return x[1:]

    x = torch.zeros(4)
    out = keraunos.jit(f)(x)
    assert_close(out, torch.ones(3))
    out.fill_(7)  # eager: out is a view of x
    assert_close(x, torch.tensor([1.0, 7.0, 7.0, 7.0]))


def test_inplace_on_input_requiring_grad_leaf_raises_like_eager():
    f = lambda x: x.add_(1)  # noqa: E731
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        f(x)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        keraunos.jit(f)(torch.randn(2, requires_grad=True))


def test_inplace_on_intermediate_with_grad():
    def f(x):
        y = x * 2
        y.relu_()
        return y.sum()

    x = torch.randn(4, requires_grad=True)
    keraunos.jit(f)(x).backward()
    expected = (x.detach() > 0).float() * 2
    assert_close(x.grad, expected)


# ----------------------------------------------------------------------------- module buffers
class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, y):
        self.total.copy_(self.total + y)
        return self.total * 2


def test_buffer_copy_matches_eager_after_several_calls():
    m, ref = Counter(), Counter()
    jm = keraunos.jit(m)
    for i in range(4):
        y = torch.randn(3)
        assert_close(jm(y), ref(y))
        assert_close(m.total, ref.total)
    assert keraunos.cache_hits(jm) == 3


def test_buffer_object_identity_is_kept_after_update():
    m = Counter()
    buf = m.total
    jm = keraunos.jit(m)
    jm(torch.ones(3))
    jm(torch.ones(3))
    assert m.total is buf
    assert_close(buf, torch.full((3,), 2.0))


class KVCache(nn.Module):
    def __init__(self, max_len=6, d=2):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, max_len, d))
        self.register_buffer("v", torch.zeros(1, max_len, d))

    def forward(self, input_pos, k, v):
        keys = self.k.index_copy_(1, input_pos, k)
        values = self.v.index_copy_(1, input_pos, v)
        return keys.sum(-1), values


def test_kv_cache_index_copy_matches_eager_after_several_calls():
    m, ref = KVCache(), KVCache()
    jm = keraunos.jit(m)
    steps = [torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([4]), torch.tensor([5])]
    for pos in steps:
        k, v = torch.randn(1, len(pos), 2), torch.randn(1, len(pos), 2)
        out, e_out = jm(pos, k, v), ref(pos, k, v)
        assert_close(out, e_out)
        assert_close(m.k, ref.k)
        assert_close(m.v, ref.v)
    # the prefill and the one-token steps: one entry each, the rest hit
    assert keraunos.cache_misses(jm) == 2
    assert keraunos.cache_hits(jm) == 2


def test_kv_cache_returned_buffer_is_the_buffer_itself():
    m = KVCache()
    jm = keraunos.jit(m)
    _, values = jm(torch.tensor([0]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert values is m.v


def test_buffer_assigned_in_forward_matches_eager():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("state", torch.zeros(2))

        def forward(self, x):
            self.state = self.state + x
            return self.state.sum()

    m, ref = M(), M()
    jm = keraunos.jit(m)
    for _ in range(3):
        x = torch.randn(2)
        assert_close(jm(x), ref(x))
        assert_close(m.state, ref.state)
    assert "state" in dict(m.named_buffers())


def test_tensor_written_to_module_attribute_is_replayed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.last = None

        def forward(self, x):
            y = self.lin(x)
            self.last = y
            return y.relu()

    m = M()
    jm = keraunos.jit(m)
    for _ in range(2):
        x = torch.randn(2, 3)
        jm(x)
        assert isinstance(m.last, torch.Tensor)
        assert_close(m.last, m.lin(x))


def test_python_attribute_write_is_replayed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * 2

    m = M()
    jm = keraunos.jit(m)
    x = torch.randn(2)
    for _ in range(3):
        assert_close(jm(x), x * 2)
    assert m.calls == 3


def test_python_attribute_write_value_used_by_program_matches_eager():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.step = 0

        def forward(self, x):
            self.step = self.step + 1
            return x * self.step

    m, ref = M(), M()
    jm = keraunos.jit(m)
    x = torch.ones(2)
    for _ in range(3):
        assert_close(jm(x), ref(x))
    assert m.step == ref.step == 3


def test_submodule_buffer_update_inside_sequential():
    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(4))

        def forward(self, x):
            self.acc.add_(x.sum(0))
            return x + self.acc

    m = nn.Sequential(nn.Linear(4, 4), Accumulate())
    ref = copy.deepcopy(m)
    jm = keraunos.jit(m)
    for _ in range(3):
        x = torch.randn(2, 4)
        assert_close(jm(x), ref(x))
    assert_close(m[1].acc, ref[1].acc)


def test_batchnorm_running_stats_update_like_eager():
    m = nn.BatchNorm1d(3)
    ref = copy.deepcopy(m)
    jm = keraunos.jit(m)
    for _ in range(3):
        x = torch.randn(4, 3)
        assert_close(jm(x), ref(x))
    assert_close(m.running_mean, ref.running_mean)
    assert_close(m.running_var, ref.running_var)
    assert m.num_batches_tracked.item() == ref.num_batches_tracked.item() == 3


class _StatisticsOnly(nn.Module):
    """A BatchNorm (and an InstanceNorm that tracks statistics) run for their running
    statistics: one result unused, one used twice."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.inorm = nn.InstanceNorm1d(4, track_running_stats=True)

    def forward(self, x):
        self.bn(x)  # only its running statistics change
        self.inorm(x.unsqueeze(-1).expand(-1, -1, 3))
        return self.bn(x * 2) + self.bn(x * 2)  # two updates, not one merged


@pytest.mark.parametrize("fuse", ["off", "wait"])
def test_normalizations_update_running_statistics_even_when_their_result_is_unused(fuse):
    """Their schemas mark no argument written and fake kernels bump no version counter: dead
    code elimination dropped the unused one (the statistics stayed as they were) and a merge of
    the two identical calls would update once."""
    torch.manual_seed(0)
    model = _StatisticsOnly()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model, fuse=fuse)
    for _ in range(3):
        x = torch.randn(5, 4)
        assert_close(jitted(x), eager(x))
    for (name, got), want in zip(model.named_buffers(), eager.buffers()):
        assert_close(got, want, msg=name)
    assert model.bn.num_batches_tracked.item() == 9


# --------------------------------------------------------------------------- storage aliases
def test_same_tensor_passed_twice():
    f = lambda a, b: a * 2 + b  # noqa: E731
    x = torch.randn(3)
    assert_close(keraunos.jit(f)(x, x), f(x, x))


def test_same_tensor_passed_twice_with_inplace_write_through_one():
    def f(a, b):
        a.add_(1)
        return b * 2  # eager: b sees the write through a

    x = torch.zeros(3)
    out = keraunos.jit(f)(x, x)
    y = torch.zeros(3)
    e_out = f(y, y)
    assert_close(out, e_out)
    assert_close(x, y)


def test_overlapping_views_passed_with_inplace_write():
    def f(a, b):
        a.mul_(2)
        return b + 0

    x, y = torch.arange(5.0), torch.arange(5.0)
    out = keraunos.jit(f)(x, x[1:])
    e_out = f(y, y[1:])
    assert_close(out, e_out)
    assert_close(x, y)


def test_write_through_view_argument_visible_in_base_argument():
    def f(a, b):
        b.fill_(-1)
        return a.sum()

    x, y = torch.arange(5.0), torch.arange(5.0)
    out = keraunos.jit(f)(x, x[1:3])
    e_out = f(y, y[1:3])
    assert_close(out, e_out)
    assert_close(x, y)


def test_alias_pattern_change_recompiles():
    def f(a, b):
        a.add_(1)
        return a + b

    jf = keraunos.jit(f)
    x1, x2 = torch.zeros(3), torch.zeros(3)
    assert_close(jf(x1, x2), torch.ones(3))
    x = torch.zeros(3)
    y = torch.zeros(3)
    out = jf(x, x)
    assert_close(out, f(y, y))  # both are the updated x: 2
    assert_close(x, y)
    assert keraunos.cache_misses(jf) == 2
    assert any("alias" in r or "share memory" in r for r in keraunos.last_cache_miss_reasons(jf)), \
        keraunos.last_cache_miss_reasons(jf)
    z = torch.zeros(3)
    jf(z, z)
    assert keraunos.cache_hits(jf) == 1


def test_aliased_then_distinct_inputs_recompiles():
    def f(a, b):
        b.mul_(3)
        return a.clone()

    jf = keraunos.jit(f)
    x = torch.ones(3)
    assert_close(jf(x, x), torch.full((3,), 3.0))
    p, q = torch.ones(3), torch.ones(3)
    assert_close(jf(p, q), torch.ones(3))
    assert_close(q, torch.full((3,), 3.0))
    assert keraunos.cache_misses(jf) == 2


def test_buffer_passed_as_argument_to_its_module():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(3))

        def forward(self, x):
            self.buf.add_(1)
            return x * 2  # eager: x is the buffer when the caller passes it

    m, ref = M(), M()
    jm = keraunos.jit(m)
    for _ in range(2):
        assert_close(jm(m.buf), ref(ref.buf))
        assert_close(m.buf, ref.buf)
    x = torch.ones(3)
    assert_close(jm(x), ref(torch.ones(3)))
    assert_close(m.buf, ref.buf)


def test_parameter_passed_as_argument_to_its_module():
    m = nn.Linear(3, 3)
    jm = keraunos.jit(m)
    assert_close(jm(m.weight), m(m.weight))


def test_aliased_views_with_other_offsets_give_eager_result():
    def f(a, b):
        a.mul_(2)
        return b + 0

    jf = keraunos.jit(f)
    x = torch.arange(5.0)
    jf(x, x[1:])
    y, ref = torch.arange(5.0), torch.arange(5.0)
    out = jf(y, y[:4])
    assert_close(out, f(ref, ref[:4]))
    assert_close(y, ref)


class _Accumulate(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, a, b):
        a.add_(b)  # eager: b sees the write when it is a's memory
        return b * self.w


def _accumulate_inputs(shared: bool):
    # Inputs that require grad: the program works on copies of them and writes back after.
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), requires_grad=True).clone()
    return (x, x.view(5, 4)) if shared else (x, x.clone())


def test_a_program_shared_by_identical_modules_serves_only_inputs_shared_alike():
    """Identical blocks of a fully_shard'ed model share one compiled program (runtime/rebind.py); one
    captured for inputs of their own must not serve a call whose inputs are one memory."""
    from keraunos.runtime.call import state_of

    first, second = _Accumulate(), _Accumulate()
    jitted_first, jitted_second = keraunos.jit(first), keraunos.jit(second)
    # What runtime/jitted.py does for the units fully_shard makes of identical blocks.
    family = weakref.WeakSet([state_of(jitted_first), state_of(jitted_second)])
    state_of(jitted_first).siblings = state_of(jitted_second).siblings = family
    jitted_first(*_accumulate_inputs(shared=False))
    own, reference = _accumulate_inputs(shared=False), _accumulate_inputs(shared=False)
    assert_close(jitted_second(*own), second(*reference))
    assert "rebind to an identical module" in keraunos.compile_stats(jitted_second).stages
    shared, reference = _accumulate_inputs(shared=True), _accumulate_inputs(shared=True)
    assert_close(jitted_second(*shared), second(*reference))
    assert_close(shared[0], reference[0])
    assert "capture" in keraunos.compile_stats(jitted_second).stages


def test_input_written_and_also_closure_tensor():
    state = torch.zeros(2)

    def f(x):
        state.add_(x)
        return state * 1

    jf = keraunos.jit(f)
    jf(torch.ones(2))
    out = jf(torch.ones(2))
    assert_close(state, torch.full((2,), 2.0))
    assert_close(out, torch.full((2,), 2.0))


def test_inplace_write_under_no_grad_to_intermediate_of_grad_input():
    def f(x):
        y = x * 2
        with torch.no_grad():
            y.add_(1)
        return y

    x = torch.ones(2, requires_grad=True)
    out, expected = keraunos.jit(f)(x), f(x)
    assert_close(out, expected)
    out.sum().backward()
    assert_close(x.grad, torch.full((2,), 2.0))


def test_inplace_update_of_leaf_parameter_under_no_grad():
    def step(p, g):
        with torch.no_grad():
            p.add_(g, alpha=-0.1)

    jf = keraunos.jit(step)
    p, g = torch.ones(3, requires_grad=True), torch.ones(3)
    jf(p, g)
    jf(p, g)
    assert_close(p.detach(), torch.full((3,), 0.8))
    assert p.requires_grad and p.is_leaf and p.grad_fn is None


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_inplace_update_reading_grad_of_written_input():
    def step(params):
        with torch.no_grad():
            for p in params:
                p.sub_(p.grad * 0.5)

    m = nn.Linear(2, 2)
    ref = copy.deepcopy(m)
    x = torch.randn(1, 2)
    m(x).sum().backward()
    ref(x).sum().backward()
    keraunos.jit(step)(list(m.parameters()))
    step(list(ref.parameters()))
    assert_close(m.weight, ref.weight)
    assert_close(m.bias, ref.bias)
