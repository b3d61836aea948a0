"""In-place writes to inputs under autograd, compared with eager PyTorch.

A program that writes an input in place works on a copy inside the computation and the epilogue
copies the new value back. When something requires grad, that copy is recorded for autograd, the
forward saves what the backward needs, and the copy-back connects the input to the result. Each
test runs the same program eagerly and jitted (twice: the compiling call and a cache hit) on
fresh, identical inputs and compares the outputs, the inputs' contents after the call, their
``requires_grad``, and the gradients of every leaf.

The inputs a program writes are never leaves that require grad (eager refuses that); they are
clones or views of clones of such leaves ("base" requires grad), plain tensors while another
input requires grad ("other"), or both. Their layouts cover dense inputs, slices of a larger
storage, transposed and strided views, and inputs that share memory with another argument.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import keraunos

# Without a backward trace the gradients would come from torch's own recording of the forward,
# and these tests would not test keraunos' autograd at all.
pytestmark = pytest.mark.filterwarnings("error:keraunos. no backward trace")


# ----------------------------------------------------------------------------------- helpers
def _loss(outputs, inputs):
    """A loss that reaches every output and every input the program wrote, with weights that
    tell the elements apart (a sum would hide a gradient in the wrong place)."""
    gen = torch.Generator().manual_seed(1)
    total = 0
    for t in list(outputs) + list(inputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            total = total + (t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
    return total


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _run(fn, make_inputs):
    """Outputs, the inputs after the call, and the leaves' gradients of one run."""
    leaves, inputs = make_inputs()
    outputs = _as_tuple(fn(*inputs))
    # What the inputs view is observed too: a write to a slice changes its base's history.
    bases = [t._base for t in inputs if isinstance(t, torch.Tensor) and t._base is not None]
    loss = _loss(outputs, inputs + bases)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return outputs, inputs + bases, leaves


def assert_matches_eager(fn, make_inputs, calls=2):
    """``make_inputs()`` returns (leaves, inputs), fresh and identical on every call."""
    jitted = keraunos.jit(fn)
    expected_outputs, expected_inputs, expected_leaves = _run(fn, make_inputs)
    for call in range(calls):
        outputs, inputs, leaves = _run(jitted, make_inputs)
        where = f"call {call}"
        assert len(outputs) == len(expected_outputs)
        for got, want in zip(outputs, expected_outputs):
            assert_close(got, want, msg=lambda m: f"{where}, output: {m}")
            assert got.requires_grad == want.requires_grad, f"{where}: output requires_grad"
        for i, (got, want) in enumerate(zip(inputs, expected_inputs)):
            if isinstance(want, torch.Tensor):
                assert_close(got, want, msg=lambda m, i=i: f"{where}, input {i} after the call: {m}")
                assert got.requires_grad == want.requires_grad, f"{where}: input {i} requires_grad"
        for i, (got, want) in enumerate(zip(leaves, expected_leaves)):
            if want.grad is None:
                assert got.grad is None, f"{where}: leaf {i} got a gradient eager does not give"
            else:
                assert got.grad is not None, f"{where}: leaf {i} got no gradient"
                assert_close(got.grad, want.grad, msg=lambda m, i=i: f"{where}, grad of leaf {i}: {m}")
    return jitted


def _seeded(make):
    """``make`` run under a fixed seed, so that every call builds the same values."""
    def make_inputs():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return make()
    return make_inputs


def _leaf(*shape, requires_grad=True):
    return torch.randn(*shape).requires_grad_(requires_grad)


# ------------------------------------------------------------------ the op x layout x grad matrix
# Each op writes ``t`` in place, possibly reading ``w`` (same shape, may require grad) and the
# boolean mask ``m``; it returns what the in-place op returns.
OPS = {
    "add_": lambda t, w, m: t.add_(w),
    "mul_": lambda t, w, m: t.mul_(w),
    "clamp_": lambda t, w, m: t.clamp_(-0.5, 0.5),
    "abs_": lambda t, w, m: t.abs_(),
    "pow_": lambda t, w, m: t.pow_(2),
    "sigmoid_": lambda t, w, m: t.sigmoid_(),
    "relu_": lambda t, w, m: t.relu_(),
    "tanh_": lambda t, w, m: t.tanh_(),
    "exp_": lambda t, w, m: t.exp_(),
    "copy_": lambda t, w, m: t.copy_(w * 2),
    "masked_fill_": lambda t, w, m: t.masked_fill_(m, 0.5),
    "masked_scatter_": lambda t, w, m: t.masked_scatter_(m, w * 3),
    "index_put_": lambda t, w, m: t.index_put_((torch.tensor([0, 2]),), w[:2] + 1),
    "setitem": lambda t, w, m: t.__setitem__(1, w[0] * 4) or t,
}
UNARY = ["add_", "mul_", "clamp_", "abs_", "pow_", "sigmoid_", "relu_", "tanh_", "exp_"]


def _written(x, layout):
    """The input the program writes, a (4, 3) tensor made from ``x`` in ``layout``, and the
    read-only second input ``z`` (sharing memory with it when ``layout`` is "aliased")."""
    if layout == "dense":
        return x.clone(), None
    if layout == "slice":  # rows 1..4 of a (6, 3) storage
        return torch.cat([x[:1], x, x[:1]]).clone()[1:5], None
    if layout == "transposed":
        return x.t().clone().t(), None
    if layout == "strided":  # every other column of a (4, 6) storage
        return torch.stack([x, -x], dim=2).reshape(4, 6).clone()[:, ::2], None
    if layout == "aliased":  # z overlaps the last two rows of x
        storage = torch.cat([x, x[:2] * 2]).clone()
        return storage[:4], storage[2:6]
    raise ValueError(layout)


LAYOUTS = ["dense", "slice", "transposed", "strided", "aliased"]
GRADS = ["base", "other", "both"]  # which requires grad: the written input's base, w, or both


def _matrix_inputs(layout, grad):
    def make():
        x = _leaf(4, 3, requires_grad=grad in ("base", "both"))
        w = _leaf(4, 3, requires_grad=grad in ("other", "both"))
        m = torch.rand(4, 3) > 0.5
        written, z = _written(x, layout)
        if z is None:
            z = torch.randn(4, 3)
        return [x, w], [written, w, z, m]
    return _seeded(make)


def _program(op):
    def program(x, w, z, m):
        y = op(x, w, m)
        return y * 2, x * w + z
    return program


def _program_through_view(op):
    def program(x, w, z, m):
        y = op(x.unsqueeze(0), w.unsqueeze(0), m.unsqueeze(0))
        return y * 2, x * w + z
    return program


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(OPS))
def test_inplace_write_to_input_matches_eager(name, layout, grad):
    assert_matches_eager(_program(OPS[name]), _matrix_inputs(layout, grad))


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("name", UNARY)
def test_inplace_write_through_a_view_of_the_input_matches_eager(name, grad):
    assert_matches_eager(_program_through_view(OPS[name]), _matrix_inputs("dense", grad))


# ------------------------------------------------------------------------- defect 5 (issue 8)
@pytest.mark.parametrize("name", ["clamp_", "abs_", "pow_"])
def test_inplace_op_that_saves_its_input_is_not_lost(name):
    # These ops save the input's value before the write for their backward, so the joint
    # recording sees the input's working copy twice; the write once went to the input instead.
    ops = {"clamp_": lambda x: x.clamp_(-1, 1) * 1, "abs_": lambda x: x.abs_() * 1,
           "pow_": lambda x: x.pow_(3) * 1}

    def make():
        leaf = (torch.randn(5) * 3).requires_grad_()
        return [leaf], [leaf.clone()]
    assert_matches_eager(ops[name], _seeded(make))


# ------------------------------------------------------------------------- defect 6 (issue 8)
SAVES_RESULT = {"sigmoid_": torch.Tensor.sigmoid_, "relu_": torch.Tensor.relu_,
                "tanh_": torch.Tensor.tanh_, "exp_": torch.Tensor.exp_}


def _clone_of_leaf():
    leaf = torch.randn(2, 3).requires_grad_()
    return [leaf], [leaf.clone()]


@pytest.mark.parametrize("name", list(SAVES_RESULT))
def test_inplace_op_saving_its_result_written_to_input(name):
    # The backward reads the op's result; the forward once saved the input itself, which the
    # copy-back then changed: "modified by an inplace operation" in the backward.
    op = SAVES_RESULT[name]
    assert_matches_eager(lambda x: op(x) * 2, _seeded(_clone_of_leaf))


@pytest.mark.parametrize("name", list(SAVES_RESULT))
def test_inplace_op_saving_its_result_through_a_view_of_the_input(name):
    # The saved result is a view of the working copy, made before the write and returned
    # from the Function as the input's new value.
    op = SAVES_RESULT[name]
    assert_matches_eager(lambda x: op(x.unsqueeze(0)) * 2, _seeded(_clone_of_leaf))
    assert_matches_eager(lambda x: (op(x[1:]) * 2, x.sum()), _seeded(_clone_of_leaf))


@pytest.mark.parametrize("name", list(SAVES_RESULT))
def test_inplace_op_result_saved_and_input_returned(name):
    op = SAVES_RESULT[name]
    assert_matches_eager(lambda x: (x * 3, op(x).sum()), _seeded(_clone_of_leaf))



# ------------------------------------------------------------------------- defect 7 (issue 8)
def test_masked_scatter_into_a_strided_input_sends_gradient_to_the_source():
    def make():
        source = torch.randn(12, requires_grad=True)
        storage = torch.randn(4, 6)
        mask = torch.rand(4, 3) > 0.5
        return [source], [storage[:, ::2], mask, source]
    assert_matches_eager(lambda x, m, s: x.masked_scatter_(m, s) * 2, _seeded(make))


def test_write_to_a_slice_keeps_the_gradient_of_the_rest_of_its_storage():
    # The working copy is the whole storage, a view of the slice's base: the rows outside the
    # slice (never written) must still send their gradient back to the leaf.
    def make():
        leaf = torch.randn(6, 3, requires_grad=True)
        w = torch.randn(2, 3, requires_grad=True)
        base = leaf.clone()
        return [leaf, w], [base[2:4], w]
    assert_matches_eager(lambda x, w: x.mul_(w).sum(), _seeded(make))


def test_write_to_one_of_two_overlapping_arguments_reaches_the_other():
    def make():
        leaf = torch.randn(8, requires_grad=True)
        w = torch.randn(5, requires_grad=True)
        base = leaf.clone()
        return [leaf, w], [base[:5], base[3:], w]
    assert_matches_eager(lambda x, z, w: (x.add_(w) * z[:1], z * 3), _seeded(make))


# ------------------------------------------------------------------------- defect 8 (issue 8)
# An op the forward runs as its ATen ops (because the backward needs what exists only inside it,
# like the operands of einsum's bmm) once read the input written in place under its old name,
# so it saw the value from before the write.
LOWERED = {
    "einsum dot": lambda y, x: torch.einsum("...i,...i->...", y, x),
    "einsum bmm": lambda y, x: torch.einsum("bij,bkj->bik", y, x),
    "group_norm": lambda y, x: torch.nn.functional.group_norm(x * y, 2),
    "cross_entropy": lambda y, x: torch.nn.functional.cross_entropy(
        (x * y).reshape(-1, 3), torch.tensor([0, 2, 1, 0, 1, 2, 0, 1])),
}


@pytest.mark.parametrize("grad", ["x", "y", "both"])
@pytest.mark.parametrize("name", list(LOWERED))
def test_op_run_as_aten_ops_reads_the_input_after_its_write(name, grad):
    op = LOWERED[name]

    def make():
        y = torch.randn(2, 4, 3).requires_grad_(grad in ("y", "both"))
        leaf = torch.randn(2, 4, 3).requires_grad_(grad in ("x", "both"))
        return [y, leaf], [y, leaf.clone()]
    assert_matches_eager(lambda y, x: op(y, x.mul_(2)), _seeded(make))


def test_einsum_after_a_write_to_the_input_gives_the_new_value():
    def make():
        y = torch.ones(3, requires_grad=True)
        return [y], [y, torch.ones(3)]
    jitted = assert_matches_eager(
        lambda y, x: (x.mul_(2), torch.einsum("...i,...i->...", y, x))[1], _seeded(make))
    assert jitted(torch.ones(3), torch.ones(3)).item() == 6.0


# ------------------------------------------------------------------------- defect 9 (issue 8)
# ``x[mask]`` has as many elements as the mask has True values: the backward needs that size,
# and once read it from a forward tensor it was never given ("name 't0' is not defined").
MASKED = {
    "sum": lambda x, m: x[m].sum(),
    "mean": lambda x, m: x[m].mean(),
    "weighted": lambda x, m: (x[m] * x[m]).sum(),
    "two masks": lambda x, m: x[m].sum() + x[~m].pow(2).sum(),
    "returned": lambda x, m: x[m] * 2,
    "after a write": lambda x, m: x.mul_(3)[m].sum(),
}


@pytest.mark.parametrize("name", list(MASKED))
def test_boolean_mask_indexing_then_backward(name):
    def make():
        leaf = torch.randn(4, 5, requires_grad=True)
        x = leaf.clone() if name == "after a write" else leaf
        return [leaf], [x, torch.rand(4, 5) > 0.4]
    assert_matches_eager(MASKED[name], _seeded(make))


def test_boolean_mask_indexing_with_another_count_of_true_values():
    # The size is read on every call, not baked in from the compiling call.
    f = keraunos.jit(lambda x, m: (x[m] * 2).sum())
    for count in (3, 7):
        x = torch.randn(10, requires_grad=True)
        m = torch.arange(10) < count
        f(x, m).backward()
        expected = torch.where(m, 2.0, 0.0)
        assert_close(x.grad, expected)


def test_masked_output_that_gets_no_gradient():
    # The zeros standing for its gradient have the call's data-dependent shape.
    def make():
        leaf = torch.randn(6, requires_grad=True)
        return [leaf], [leaf, torch.rand(6) > 0.5]

    def program(x, m):
        return x[m] * 2, x.sum() * 3
    jitted = keraunos.jit(program)
    for _ in range(2):
        (leaf,), (x, m) = _seeded(make)()
        jitted(x, m)[1].backward()
        (ref,), (y, n) = _seeded(make)()
        program(y, n)[1].backward()
        assert_close(leaf.grad, ref.grad)


# ------------------------------------------------------------------------ more in-place programs
MORE = {
    "several writes": lambda x, w, m: (x.mul_(2), x.add_(w), x.clamp_(-1, 1), x * w)[-1],
    "setitem on a view": lambda x, w, m: (x[1:].__setitem__(0, w[0]), x * 2)[-1],
    "masked_fill_ on a transpose": lambda x, w, m: (x.t().masked_fill_(m.t(), 0.0), x * w)[-1],
    "mask setitem": lambda x, w, m: (x.__setitem__(m, 0.0), x * w)[-1],
    "mask setitem from w": lambda x, w, m: (x.__setitem__(m, w[m]), x * 2)[-1],
    "mask read, then written": lambda x, w, m: (x.__setitem__(m, x[m] + w[m]), x * 2)[-1],
    "index_add_": lambda x, w, m: x.index_add_(0, torch.tensor([0, 2]), w[:2]) * 1,
    "scatter_": lambda x, w, m: x.scatter_(1, torch.tensor([[0], [1], [2], [0]]), w[:, :1]) * 1,
    "addcmul_": lambda x, w, m: x.addcmul_(w, w, value=0.5) * 1,
    "lerp_": lambda x, w, m: x.lerp_(w, 0.3) * 1,
    "div_ then sub_": lambda x, w, m: x.div_(2).sub_(w) * 1,
    "zero_": lambda x, w, m: (x.zero_(), x + w)[-1],
    "fill_": lambda x, w, m: (x.fill_(2.0), x * w)[-1],
    "nonzero after a write": lambda x, w, m: (x.mul_(w), x[m.nonzero(as_tuple=True)].sum())[-1],
    "einsum of a written view": lambda x, w, m: torch.einsum("ij,ij->i", x[:, :2].mul_(2),
                                                             w[:, :2]),
}


def _more_inputs(layout, grad):
    def make():
        x = _leaf(4, 3, requires_grad=grad in ("base", "both"))
        w = _leaf(4, 3, requires_grad=grad in ("other", "both"))
        m = torch.rand(4, 3) > 0.5
        written = x.clone() if layout == "dense" else torch.cat([x, x]).clone()[2:6]
        return [x, w], [written, w, m]
    return _seeded(make)


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("layout", ["dense", "slice"])
@pytest.mark.parametrize("name", list(MORE))
def test_more_inplace_programs_match_eager(name, layout, grad):
    assert_matches_eager(MORE[name], _more_inputs(layout, grad))


def test_two_inputs_written_in_place():
    def make():
        x, w = _leaf(4, 3), _leaf(4, 3)
        return [x, w], [x.clone(), w.clone()[:, :]]
    assert_matches_eager(lambda x, w: (x.add_(1), w.mul_(x), x * w)[-1], _seeded(make))


def test_reading_the_grad_of_an_input_gets_a_backward():
    # The joint recording's fake inputs have no .grad: it stands in one of the captured shape.
    def make():
        p = torch.randn(3, requires_grad=True)
        p.grad = torch.randn(3)
        return [p], [p]
    assert_matches_eager(lambda p: p * p.grad, _seeded(make))


# ------------------------------------------------------------ gradients accumulated over calls
ACCUMULATED = {
    # CSE turns the two products' gradients into one tensor, whose two views are the gradients
    # of a and b: kept as two .grad over one memory, each later call added into both.
    "two views of one gradient": lambda x, a, b: x * a.view(4) + x * b.view(2, 2).reshape(4),
    "a view and the gradient itself": lambda x, a, b: x * a.view(2, 2).reshape(4) + x * b[0, 0],
    "slices of one gradient": lambda x, a, b: x * torch.cat([a[:2], b.reshape(4)[2:]]),
}


@pytest.mark.parametrize("name", list(ACCUMULATED))
def test_gradients_accumulated_over_calls(name):
    program = ACCUMULATED[name]

    def make():
        return torch.randn(4), torch.randn(4, requires_grad=True), torch.randn(2, 2,
                                                                             requires_grad=True)
    jitted = keraunos.jit(program)
    x, a, b = _seeded(make)()
    _, a_ref, b_ref = _seeded(make)()
    for _ in range(3):
        jitted(x, a, b).sum().backward()
        program(x, a_ref, b_ref).sum().backward()
    assert_close(a.grad, a_ref.grad)
    assert_close(b.grad, b_ref.grad)
