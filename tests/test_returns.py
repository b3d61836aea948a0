"""Returned views and inputs: the same objects, layouts, bases and autograd state as eager.

Each test runs a program eagerly and jitted through the same sequence of calls (new bases, other
storage offsets, grad on and off), building fresh inputs for both sides from one recipe, and
compares everything a caller can see of the results: values, layout, which input each result is
or shares memory with, which results are the same object, requires_grad, and the gradients that
reach the leaves.
"""
import pytest
import torch
from torch.testing import assert_close
from torch.utils import _pytree as pytree

import keraunos


def leaf(n, grad):
    return torch.arange(float(n)).requires_grad_(grad)


def describe(out, inputs):
    """What a caller can observe of each returned tensor, in terms of the inputs and each other."""
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    rows = []
    for i, t in enumerate(tensors):
        shares = [j for j, x in enumerate(inputs)
                  if t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()]
        rows.append(dict(
            shape=tuple(t.shape), stride=t.stride(), offset=t.storage_offset(),
            is_input=[j for j, x in enumerate(inputs) if t is x],
            same_as=[j for j, u in enumerate(tensors[:i]) if t is u],
            shares_storage_with=shares, requires_grad=t.requires_grad, is_leaf=t.is_leaf,
            has_grad_fn=t.grad_fn is not None))
    return tensors, rows


def backward_through(tensors):
    """Sum every returned tensor that requires grad, each with its own weight, and backward."""
    terms = [(t * (k + 1)).sum() for k, t in enumerate(tensors) if t.requires_grad]
    if terms:
        sum(terms).backward()


def check_calls(fn, recipes, grads=(False, True), backward=True):
    """Call ``fn`` eagerly and jitted for each recipe in turn (one jitted function per grad setting,
    so later calls reuse or extend its cache) and compare what the caller sees; returns the
    jitted functions."""
    jitted = []
    for grad in grads:
        jf = keraunos.jit(fn)
        jitted.append(jf)
        for recipe in recipes:
            sides = []
            for f in (fn, jf):
                leaves, inputs = recipe(grad)
                out = f(*inputs)
                tensors, rows = describe(out, inputs)
                values = [t.detach().clone() for t in tensors]
                inputs_after = [x.detach().clone() for x in inputs]
                if backward:
                    backward_through(tensors)
                grads_seen = [None if p.grad is None else p.grad.clone() for p in leaves]
                sides.append((type(out), rows, values, inputs_after, grads_seen))
            (e_type, e_rows, e_values, e_inputs, e_grads), (j_type, j_rows, j_values, j_inputs,
                                                          j_grads) = sides
            assert j_type is e_type
            assert j_rows == e_rows, (grad, recipe.__name__)
            assert_close(j_values, e_values)
            assert_close(j_inputs, e_inputs)
            assert [g is None for g in j_grads] == [g is None for g in e_grads]
            assert_close([g for g in j_grads if g is not None],
                         [g for g in e_grads if g is not None])
    return jitted


def assert_cache_served_other_offsets(jitted):
    # The point of these tests: a cached program meets the same layout at another offset.
    assert all(keraunos.cache_hits(jf) >= 2 for jf in jitted)


# --------------------------------------------------------- recipes: where the inputs live
def rows_0_to_3(grad):
    base = leaf(12, grad)
    return [base], [(base.clone() if grad else base).view(4, 3)[:3]]


def rows_1_to_4(grad):
    base = leaf(12, grad)
    return [base], [(base.clone() if grad else base).view(4, 3)[1:]]


def rows_of_another_base(grad):
    base = leaf(30, grad)
    return [base], [(base.clone() if grad else base).view(10, 3)[5:8]]


def own_storage(grad):
    base = leaf(9, grad)
    return [base], [base.clone().view(3, 3)]


def leaf_itself(grad):
    x = torch.arange(9.).view(3, 3).clone().requires_grad_(grad)
    return [x], [x]


OFFSETS = [rows_0_to_3, rows_1_to_4, rows_of_another_base, own_storage, rows_1_to_4]


# ------------------------------------------------------------------ 1. views follow offsets
@pytest.mark.parametrize("view", [
    lambda x: x[1:],
    lambda x: x[:, 1],
    lambda x: x.t()[1:],
    lambda x: x.reshape(-1)[2:7],
    lambda x: x.unsqueeze(0).expand(2, 3, 3),
    lambda x: x.diagonal(),
    lambda x: (x[1], x[2:], x.t()),
    lambda x: x.narrow(0, 1, 2).mT,
    lambda x: x.split(1),
    # as_strided names its storage offset: absolute, whatever the input's own offset.
    lambda x: torch.as_strided(x, (2,), (4,), 1),
    lambda x: x.as_strided((2, 2), (3, 1), 2)[1:],
], ids=["slice", "column", "transposed", "flat", "expanded", "diagonal", "several", "narrow",
        "split", "as_strided", "as_strided_method"])
def test_returned_view_of_input_follows_its_storage_offset(view):
    assert_cache_served_other_offsets(check_calls(view, OFFSETS))


def test_returned_view_next_to_computed_value_follows_offset():
    assert_cache_served_other_offsets(check_calls(lambda x: (x * 2, x[1:]), OFFSETS))


def test_returned_view_of_leaf_input():
    check_calls(lambda x: (x[1:], x.sum()), [leaf_itself, leaf_itself])


def test_returned_view_of_input_written_in_place_follows_offset():
    # A dense input first (the copy-back path for one tensor), then a slice at offset 3 of the
    # same shape and strides, then of another base.
    def written_then_viewed(x):
        x.add_(1)
        return x[1:], x[:, 0]
    jitted = check_calls(written_then_viewed, [own_storage, rows_1_to_4, rows_of_another_base,
                                               own_storage])
    assert_cache_served_other_offsets(jitted)


def transposed_in_place(x):
    x.t_()
    return x, x[1:]


def squeezed_in_place(x):
    x.unsqueeze_(0)
    return x[0, 1:], x


def test_input_whose_layout_the_program_changes_keeps_its_offset():
    # The copy-back gives the input its new layout at its own offset, not the compiling call's:
    # a wrong offset would also write the new values to the wrong part of the storage.
    check_calls(transposed_in_place, [own_storage, rows_1_to_4, rows_of_another_base])
    jitted = check_calls(squeezed_in_place, [own_storage, rows_1_to_4, rows_of_another_base])
    assert_cache_served_other_offsets(jitted)


def test_as_strided_view_of_input_written_in_place_keeps_its_named_offset():
    def written_then_strided(x):
        x.mul_(3)
        return x.as_strided((2,), (2,), 1), x[1:]
    jitted = check_calls(written_then_strided, [own_storage, rows_1_to_4, rows_of_another_base])
    assert_cache_served_other_offsets(jitted)


def test_returned_view_of_shared_storage_input_written_in_place():
    def write_one_view_other(a, b):
        a.mul_(2)
        return b[1:], a.t()

    def overlapping(grad):
        base = leaf(12, grad)
        r = base.clone()
        return [base], [r[:6].view(2, 3), r[3:9].view(3, 2)]
    check_calls(write_one_view_other, [overlapping, overlapping])


# ------------------------------------------------- 2. a view is rebuilt from what it views
def halves(grad):
    base = leaf(10, grad)
    r = base.clone()
    return [base], [r[5:], r[:5]]


def halves_of_another_base(grad):
    base = leaf(16, grad)
    r = base.clone()
    return [base], [r[8:13], r[1:6]]


def overlapping_rows(grad):
    base = leaf(12, grad)
    r = base.clone().view(4, 3)
    return [base], [r[1:3], r[:2]]


def test_view_of_second_argument_sharing_storage_with_first():
    jitted = check_calls(lambda b, a: a.t(), [halves, halves_of_another_base, halves])
    assert all(keraunos.cache_hits(jf) >= 1 for jf in jitted)


def test_views_of_each_of_two_overlapping_arguments():
    check_calls(lambda a, b: (b[1:], a[:, 1], b.t()), [overlapping_rows, overlapping_rows])


def test_view_of_second_argument_next_to_computed_value():
    check_calls(lambda b, a: (a[1:], b * 3), [halves, halves_of_another_base])


# ---------------------------------------------------------- 3. detached and no_grad views
def detach_next_to_value(x):
    return x * 2, x.detach()


def detach_only(x):
    return x.detach()


def view_of_detached(x):
    return x.sum(), x.detach()[1:]


def detached_view(x):
    return x[1:].detach(), x * 3


def view_under_no_grad(x):
    with torch.no_grad():
        v = x[1:]
    return v, x * 2


def view_under_no_grad_only(x):
    with torch.no_grad():
        return x.t()


@pytest.mark.parametrize("program", [detach_next_to_value, detach_only, view_of_detached,
                                     detached_view, view_under_no_grad, view_under_no_grad_only])
def test_detached_and_no_grad_views_are_as_in_eager(program):
    check_calls(program, [rows_0_to_3, rows_1_to_4, own_storage])
    check_calls(program, [leaf_itself, leaf_itself])


def test_detached_view_gets_no_gradient():
    x = torch.randn(4, requires_grad=True)
    y, d = keraunos.jit(detach_next_to_value)(x)
    assert not d.requires_grad and d.grad_fn is None
    (y.sum() + (d * 5).sum()).backward()
    assert_close(x.grad, torch.full((4,), 2.0))


def test_view_made_under_no_grad_cannot_be_written_with_grad_on_as_in_eager():
    x = torch.randn(4, requires_grad=True).clone()
    eager_view, _ = view_under_no_grad(x)
    jit_view, _ = keraunos.jit(view_under_no_grad)(x)
    for v in (eager_view, jit_view):
        with pytest.raises(RuntimeError, match="no_grad"):
            v.mul_(2)


# -------------------------------------------------------------------------- 4. identity
def two_inputs(grad):
    x, y = leaf(3, grad), leaf(4, False) + 1
    return [x], [x, y]


def two_leaves(grad):
    x, y = leaf(3, grad), leaf(4, grad)
    return [x, y], [x, y]


def one_leaf(grad):
    x = leaf(6, grad)
    return [x], [x]


def one_non_leaf(grad):
    x = leaf(6, grad)
    return [x], [x.clone()]


@pytest.mark.parametrize("program", [
    lambda x, y: (x * 2, y),
    lambda x, y: (y, x * 2, x),
    lambda x, y: (x, y, x),
    lambda x, y: {"a": x, "b": [y, x.sum()]},
    lambda x, y: y,
], ids=["other_input", "both_inputs", "input_twice", "nested", "only_input"])
def test_returned_input_is_the_very_object(program):
    check_calls(program, [two_inputs, two_inputs])
    check_calls(program, [two_leaves, two_leaves])


@pytest.mark.parametrize("program", [
    lambda x: (x * 2, x),
    lambda x: x,
    lambda x: (x, x),
], ids=["with_value", "alone", "twice"])
def test_returned_leaf_or_non_leaf_input_is_the_very_object(program):
    check_calls(program, [one_leaf, one_leaf])
    check_calls(program, [one_non_leaf, one_non_leaf])


def view_twice(x):
    v = x[1:]
    return v, v


def view_twice_with_value(x):
    v = x[2:]
    return v, x * 2, {"again": v}


def detached_twice(x):
    d = x.detach()
    return d, x.sum(), d


def intermediate_view_twice(x):
    v = (x * 2)[1:]
    return v, v


@pytest.mark.parametrize("program", [view_twice, view_twice_with_value, detached_twice,
                                     intermediate_view_twice])
def test_same_view_returned_twice_is_one_object(program):
    check_calls(program, [one_leaf, one_non_leaf])


def test_returned_input_is_the_object_after_a_cache_hit():
    jf = keraunos.jit(lambda x, y: (x * 2, y))
    for _ in range(3):
        x, y = torch.randn(3, requires_grad=True), torch.randn(3)
        assert jf(x, y)[1] is y
    assert keraunos.cache_hits(jf) == 2


class Remembers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("scale", torch.ones(5))

    def forward(self, x):
        self.last = x[1:]
        return self.weight, self.scale, x * self.weight, self.last


def test_returned_parameter_buffer_and_remembered_view_are_the_eager_objects():
    model = Remembers()
    jitted = keraunos.jit(model)
    for base in (torch.randn(5), torch.randn(9)[2:7], torch.randn(5)):
        weight, scale, _, last = jitted(base)
        assert weight is model.weight and scale is model.scale and last is model.last
        assert last.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert last.storage_offset() == base.storage_offset() + 1
        assert_close(last, base[1:])
    assert keraunos.cache_hits(jitted) == 2


def test_unbind_views_follow_offset_and_grad():
    check_calls(lambda x: x.unbind(1), OFFSETS)


@pytest.mark.parametrize("program", [lambda x: (x[1:], x * 2), view_twice, detach_next_to_value,
                                     lambda x: (x, x.t())])
def test_returned_views_and_inputs_in_a_no_grad_call(program):
    with torch.no_grad():
        check_calls(program, [rows_0_to_3, rows_1_to_4, leaf_itself], backward=False)
