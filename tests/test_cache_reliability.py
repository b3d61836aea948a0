"""Cache entries are used only when valid, and released with their entry (issue 8, items 10-16).

Every test compares the jitted program with eager PyTorch on twins of the same state."""
import copy
import gc
import linecache
import threading
import time
import warnings
import weakref

import torch
from torch import nn
from torch.testing import assert_close

import keraunos


def counts(jitted):
    return keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)


class AddsToBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4))
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        self.buf.add_(1)
        return x * 2


# ------------------------------------------- 10: an argument that is a view of a written buffer
def test_view_of_buffer_written_in_place_gives_eager_result():
    m = AddsToBuffer()
    e = copy.deepcopy(m)
    jm = keraunos.jit(m)
    for _ in range(2):
        out, expected = jm(m.buf[:2]), e(e.buf[:2])
        assert_close(out, expected)
        assert_close(m.buf, e.buf)
    assert counts(jm) == (1, 1)
    out, expected = jm(torch.ones(4)), e(torch.ones(4))  # no longer aliasing: another entry
    assert_close(out, expected)
    assert_close(m.buf, e.buf)


# -------------------------------------------------------- 11: CSE keeps returned values apart
def test_two_equal_returned_clones_are_two_objects():
    f = lambda x: (x.clone(), x.clone())  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    a, b = jf(x)
    ea, eb = f(x)
    assert (a is b) == (ea is eb) == False  # noqa: E712
    a.add_(1)
    ea.add_(1)
    assert_close((a, b), (ea, eb))


def test_equal_returned_results_with_grad_are_two_objects():
    f = lambda x: (x * 2, x * 2, (x * 2).sum())  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, expected = jf(x), f(x2)
    assert out[0] is not out[1]
    assert_close(out, expected)
    (out[0].sum() + 2 * out[1].sum() + out[2]).backward()
    (expected[0].sum() + 2 * expected[1].sum() + expected[2]).backward()
    assert_close(x.grad, x2.grad)


def test_cse_still_merges_a_repeat_used_inside():
    f = lambda x: x.sin() + x.sin()  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x), f(x))
    assert str(keraunos.last_traces(jf)[-1]).count("= x.sin()") == 1


# ------------------------------------------------------------ 12: signed zeros and nan constants
def same_bits(a, b):
    assert_close(a, b, equal_nan=True)
    assert torch.equal(torch.signbit(a), torch.signbit(b))


def test_negative_zero_scalar_recompiles():
    f = lambda x, s: x * s  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.ones(2)
    same_bits(jf(x, 0.0), f(x, 0.0))
    same_bits(jf(x, -0.0), f(x, -0.0))
    same_bits(jf(x, 0.0), f(x, 0.0))
    same_bits(jf(x, -0.0), f(x, -0.0))
    assert counts(jf) == (2, 2)


def test_cse_does_not_merge_opposite_zeros():
    f = lambda x: x * 0.0 + x * -0.0 * 0 + (x * -0.0)  # noqa: E731
    g = lambda x: (x * 0.0, x * -0.0)  # noqa: E731
    x = torch.ones(2)
    same_bits(keraunos.jit(f)(x), f(x))
    for out, expected in zip(keraunos.jit(g)(x), g(x)):
        same_bits(out, expected)


def test_nan_scalar_hits_and_zero_does_not_match_nan():
    f = lambda x, s: x + s  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.ones(2)
    nan = float("nan")
    same_bits(jf(x, nan), f(x, nan))
    same_bits(jf(x, float("nan")), f(x, nan))
    assert counts(jf) == (1, 1)
    same_bits(jf(x, 0.0), f(x, 0.0))
    assert counts(jf) == (2, 1)


def test_signed_zero_inside_a_list_attribute_recompiles():
    class Scales(nn.Module):
        def __init__(self):
            super().__init__()
            self.scales = [0.0]

        def forward(self, x):
            return x * self.scales[0]
    m = Scales()
    jm = keraunos.jit(m)
    x = torch.ones(2)
    same_bits(jm(x), m(x))
    m.scales[0] = -0.0
    same_bits(jm(x), m(x))


# ---------------------------------- 13: .data assignment and set_ are seen by the alias check
def test_data_assignment_then_aliasing_argument_gives_eager_result():
    class M(AddsToBuffer):
        def forward(self, x):
            self.buf.add_(1)
            return x * self.w  # with grad: the entry has a backward, the buffer is copied

    m = M()
    e = copy.deepcopy(m)
    jm = keraunos.jit(m)
    assert_close(jm(torch.ones(4)), e(torch.ones(4)))
    new, e_new = torch.zeros(4), torch.zeros(4)
    m.buf.data, e.buf.data = new, e_new  # no registration hook fires
    assert_close(jm(new), e(e_new))
    assert_close((m.buf, new), (e.buf, e_new))
    assert_close(jm(torch.ones(4)), e(torch.ones(4)))  # not aliasing again
    assert_close(m.buf, e.buf)


def test_parameter_data_assignment_then_aliasing_argument_gives_eager_result():
    class WritesArgument(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            x.mul_(2)
            return x + self.w

    m = WritesArgument()
    e = copy.deepcopy(m)
    jm = keraunos.jit(m)
    with torch.no_grad():
        assert_close(jm(torch.ones(3)), e(torch.ones(3)))
        shared, e_shared = torch.full((3,), 5.0), torch.full((3,), 5.0)
        m.w.data, e.w.data = shared, e_shared
        assert_close(jm(shared), e(e_shared))  # eager: w is x, written first: 10 + 10
        assert_close((m.w, shared), (e.w, e_shared))


def test_set_then_aliasing_argument_gives_eager_result():
    m = AddsToBuffer()
    e = copy.deepcopy(m)
    jm = keraunos.jit(m)
    with torch.no_grad():
        assert_close(jm(torch.ones(4)), e(torch.ones(4)))
        new, e_new = torch.zeros(4), torch.zeros(4)
        m.buf.set_(new)
        e.buf.set_(e_new)
        assert_close(jm(new), e(e_new))
        assert_close((m.buf, new), (e.buf, e_new))


def test_program_that_only_reads_hits_whatever_its_inputs_share():
    f = lambda a, b: a + b * 2  # noqa: E731
    jf = keraunos.jit(f)
    x, y = torch.randn(3), torch.randn(3)
    assert_close(jf(x, y), f(x, y))
    assert_close(jf(x, x.view(3)), f(x, x.view(3)))  # sharing cannot change what a reading program computes
    assert counts(jf) == (1, 1)


# ------------------------------------------------------------- 16: stage times and counters
def test_post_optimization_stage_time_counts_forward_and_backward():
    class Slow(keraunos.Transform):
        def transform_trace_post_optimization(self, trace):
            time.sleep(0.05)
            return trace

    f = lambda x: (x * 2).sin()  # noqa: E731
    jf = keraunos.jit(f, transforms=[Slow()])
    x = torch.randn(3, requires_grad=True)
    assert_close(jf(x), f(x))
    assert keraunos.last_backward_traces(jf)  # the hook ran on a forward and a backward
    assert keraunos.compile_stats(jf).stages["transform Slow (post optimization)"] >= 0.1


def test_threads_with_mixed_shapes_and_grad_modes_give_eager_results_and_exact_counters():
    f = lambda x: (x * 3).tanh().sum(0)  # noqa: E731
    jf = keraunos.jit(f, dynamic=False)  # every shape an entry of its own
    inputs = [torch.randn(n, 4) for n in (1, 2, 3)]
    errors = []

    def worker(seed):
        try:
            for i in range(500):
                x = inputs[(seed + i) % 3]
                grad = (seed + i) % 2 == 0
                with torch.set_grad_enabled(grad):
                    xi = x.detach().requires_grad_(grad)
                    out = jf(xi)
                    expected = f(xi)
                    assert out.requires_grad == expected.requires_grad
                    assert torch.equal(out, expected)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert counts(jf) == (6, 8 * 500 - 6)  # 3 shapes x 2 grad modes, each compiled once


# ------------------------------------------------ 15: an entry releases what it held when evicted
def keraunos_lines():
    """The generated sources linecache holds, as (filename, source) pairs: a freed trace's
    filename is reused by a later one, so the name alone does not say whose source it is."""
    return {(name, "".join(entry[2])) for name, entry in linecache.cache.items()
            if name.startswith("<keraunos ")}


def test_entry_does_not_keep_the_compiling_calls_tensors_alive():
    f = lambda x, y: (x * 2 + y, y.mul_(2))  # noqa: E731
    jf = keraunos.jit(f)
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    x2, y2 = x.detach().clone().requires_grad_(), y.clone()
    assert_close(jf(x, y), f(x2, y2))
    inputs = weakref.ref(x), weakref.ref(y)
    del x, y
    gc.collect()
    assert inputs[0]() is None and inputs[1]() is None
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    x2, y2 = x.detach().clone().requires_grad_(), y.clone()
    assert_close(jf(x, y), f(x2, y2))  # the entry still hits and works
    assert_close(y, y2)
    assert counts(jf) == (1, 1)


def test_evicted_entries_release_traces_and_linecache_entries():
    # With the default debug history, which keeps summaries and holds entries weakly.
    f = lambda x: x.sin() * 2  # noqa: E731
    jf = keraunos.jit(f, max_cache_entries=2, dynamic=False)  # every size its own entry
    before = keraunos_lines()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recompiling warning
        x = torch.randn(1)
        assert_close(jf(x), f(x))
        first = weakref.ref(keraunos.last_traces(jf)[-1])
        first_lines = keraunos_lines() - before
        for n in range(2, 42):  # 40 shapes through a cache of 2
            x = torch.randn(n)
            assert_close(jf(x), f(x))
    gc.collect()
    assert first() is None
    assert not first_lines & keraunos_lines()
    assert len(keraunos_lines() - before) <= 3 * len(first_lines)  # 2 entries and 1 remembered


def test_recompiling_forever_reuses_the_generated_filenames():
    # CPython 3.11 keeps every distinct filename code was compiled with for the life of the
    # process: a program that keeps recompiling must cycle through a bounded set of them.
    f = lambda x: x.cos() + 1  # noqa: E731
    jf = keraunos.jit(f, max_cache_entries=2, dynamic=False)
    gc.collect()
    # (the names of programs other tests of this process made and still hold are not this one's)
    before = {name for name, _ in keraunos_lines()}
    names_seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recompiling warning
        for n in range(1, 61):
            x = torch.randn(n)
            assert_close(jf(x), f(x))
            gc.collect()
            names_seen |= {name for name, _ in keraunos_lines()} - before
    # The files an entry generates: its traces' and its hit path's (hit_path.hit_path).
    per_entry = len(keraunos.last_prologue_traces(jf)) + len(keraunos.last_traces(jf)) + 1
    assert len(names_seen) < 60  # one new set of names per compile would be 60 x several
    assert len(names_seen) <= 4 * per_entry + 10


def test_deleted_jitted_module_and_its_model_are_freed():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    assert_close(jm(x), m(x))
    refs = weakref.ref(m), weakref.ref(jm)
    del m, jm
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


# --------------------------- 14: helpers' globals and closures, hooks added after compiling
SCALE = 2.0


def scaled(x):
    return x * SCALE


def make_adder(k):
    def add(x):
        return x + k
    return add


def test_global_read_by_a_helper_is_guarded():
    global SCALE
    f = lambda x: scaled(x).sin()  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    try:
        assert_close(jf(x), f(x))
        SCALE = 3.0
        assert_close(jf(x), f(x))
        assert counts(jf) == (2, 0)
    finally:
        SCALE = 2.0


def test_closure_value_read_by_a_helper_is_guarded():
    add = make_adder(1.0)
    f = lambda x: add(x) * 2  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x), f(x))
    add.__closure__[0].cell_contents = 5.0
    assert_close(jf(x), f(x))
    assert_close(jf(x), f(x))
    assert counts(jf) == (2, 1)


def test_global_read_by_a_submodule_forward_is_guarded():
    global SCALE

    class Scaled(nn.Module):
        def forward(self, x):
            return x * SCALE

    m = nn.Sequential(nn.Linear(3, 3), Scaled())
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    try:
        assert_close(jm(x), m(x))
        SCALE = -1.0
        assert_close(jm(x), m(x))
    finally:
        SCALE = 2.0


def test_forward_hook_added_and_removed_after_compiling_is_seen():
    m = nn.Linear(3, 3)
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    assert_close(jm(x), m(x))
    handle = m.register_forward_hook(lambda module, args, out: out * 10)
    assert_close(jm(x), m(x))
    handle.remove()
    assert_close(jm(x), m(x))
    assert counts(jm) == (2, 1)  # the entry without the hook is valid again


def test_pre_hook_on_a_submodule_added_after_compiling_is_seen():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    assert_close(jm(x), m(x))
    handle = m[2].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    assert_close(jm(x), m(x))
    handle.remove()


def test_global_module_hook_added_after_compiling_is_seen():
    m = nn.Linear(3, 3)
    jm = keraunos.jit(m)
    x = torch.randn(2, 3)
    assert_close(jm(x), m(x))
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out - 1)
    try:
        assert_close(jm(x), m(x))
    finally:
        handle.remove()
    assert_close(jm(x), m(x))


OFFSET = torch.linspace(-1.0, 1.0, 4)


def shifted(x):
    return x + OFFSET


def test_tensor_global_read_by_a_helper_is_read_on_every_call():
    global OFFSET
    f = lambda x: shifted(x) * 2  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(4, requires_grad=True)
    saved = OFFSET
    try:
        assert_close(jf(x), f(x))
        OFFSET = torch.randn(4)
        assert_close(jf(x), f(x))
    finally:
        OFFSET = saved


def test_tensor_in_a_helpers_closure_is_read_on_every_call():
    add = make_adder(torch.ones(3))
    f = lambda x: add(x) * 2  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x), f(x))
    add.__closure__[0].cell_contents = torch.full((3,), 7.0)
    assert_close(jf(x), f(x))
