"""Regressions found by the differential fuzzer (keraunos.testing.fuzz), each compared with eager."""
import pytest
import torch

import keraunos


def test_view_made_under_no_grad_and_returned_after_its_base_is_written_in_place():
    # Capture crashed reading the fake view's grad_fn (autograd refuses it for such a view).
    def f(a, b):
        view = a[:]
        a.copy_(b.sum(1).unsqueeze(-1))
        return view

    results = []
    for fn in (f, keraunos.jit(f)):
        torch.manual_seed(0)
        leaf = torch.randn(3, 4).requires_grad_()
        a, b = leaf.clone(), torch.randn(3, 4, requires_grad=True)
        with torch.no_grad():
            out = fn(a, b)
        results.append((out, a))
    (eager, eager_a), (jitted, jitted_a) = results
    assert torch.equal(jitted, eager) and torch.equal(jitted_a, eager_a)
    assert jitted._base is jitted_a and eager._base is eager_a
    assert jitted.requires_grad == eager.requires_grad
    # Autograd refuses both views from now on, as it refuses eager's.
    for out in (eager, jitted):
        with pytest.raises(RuntimeError, match="view was created in no_grad mode"):
            out.grad_fn


def test_expression_under_no_grad_is_not_reused_outside_it():
    # CSE merged `a.t()` under no_grad with the same expression outside: the gradient was lost.
    def f(a):
        with torch.no_grad():
            detached = a.t() @ a
        return (a.t() @ a.sum(1, keepdim=True)).sum() + detached.sum()

    grads = []
    for fn in (f, keraunos.jit(f)):
        a = torch.randn(4, 3, requires_grad=True)
        torch.manual_seed(0)
        a = torch.randn(4, 3, requires_grad=True)
        out = fn(a)
        out.backward()
        grads.append((out, a.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])


def test_reduction_reused_across_a_no_grad_block_keeps_requires_grad():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(()))

        def forward(self, a):
            with torch.no_grad():
                self.buf.add_(a.sum() * 0.1)
            return a.sum()

    a = torch.randn(3, requires_grad=True)
    eager_model, model = M(), M()
    want, got = eager_model(a), keraunos.jit(model)(a)
    assert got.requires_grad == want.requires_grad and got.grad_fn is not None
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.buf, eager_model.buf)


def test_two_parameters_with_the_same_gradient_accumulate_separately():
    # Two biases get the same gradient; the backward once handed both views of one tensor to
    # autograd, which kept them as .grad, so the second step's accumulation doubled into both.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) + self.b(x)

    torch.manual_seed(0)
    eager_model = M()
    model = M()
    model.load_state_dict(eager_model.state_dict())
    jm = keraunos.jit(model)
    for step in range(3):
        x = torch.randn(2, 4)
        jm(x).pow(2).sum().backward()
        eager_model(x).pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: grad of {name}")
    assert model.a.bias.grad.data_ptr() != model.b.bias.grad.data_ptr()


def test_value_read_before_a_non_dense_input_is_written_with_grad_does_not_require_grad():
    # The flat storage of a transposed input took requires_grad from the input as the program
    # left it (after writing a value that requires grad), so what was read before the write
    # came back requiring grad.
    def f(a, b):
        before = a.sum(-1)
        a.mul_(b.mean(-1, keepdim=True))
        return before

    results = []
    for fn in (f, keraunos.jit(f)):
        torch.manual_seed(0)
        a_base, leaf = torch.randn(4, 3), torch.randn(3, 4, requires_grad=True)
        out = fn(a_base.t(), leaf.clone())
        a_base.sum().backward()
        results.append((out, a_base, leaf.grad))
    (want, want_a, want_grad), (got, got_a, got_grad) = results
    assert got.requires_grad == want.requires_grad is False
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_a, want_a)
    torch.testing.assert_close(got_grad, want_grad)


def test_view_made_after_a_no_grad_write_through_another_view_stays_usable():
    # Bumping the base's version for the refused view also made the other returned view stale.
    def f(a, s):
        t1 = a.expand_as(a)
        t1.addcmul_(t1 - s, t1 - s, value=0.5)
        return [a.transpose(0, 1)[::2], t1]

    outs = []
    for fn in (f, keraunos.jit(f)):
        torch.manual_seed(0)
        leaf = torch.randn(2, 4, requires_grad=True)
        with torch.no_grad():
            outs.append(fn(leaf.clone(), 0.5))
    for eager, jitted in zip(*outs):
        torch.testing.assert_close(jitted, eager)
    assert [_grad_fn_state(o) for o in outs[1]] == [_grad_fn_state(o) for o in outs[0]]
    assert _grad_fn_state(outs[1][0]) == "none"


def _grad_fn_state(t: torch.Tensor) -> str:
    try:
        return "none" if t.grad_fn is None else "set"
    except RuntimeError:
        return "refused by autograd"


def test_unused_read_between_two_in_place_writes_of_a_view_is_kept():
    # DCE dropped `unused = a.sum(0)`; without that read, autograd has not refreshed the view's
    # history when `clamp_` writes it and raises its leaf error, which eager (with the read) does not.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, a):
            a[1:] = self.w
            unused = a.sum(0)  # noqa: F841
            a.clamp_(min=0.0)
            return None

    results = []
    for jit in (False, True):
        torch.manual_seed(0)
        model = M()
        base = torch.randn(5, 4)
        (keraunos.jit(model) if jit else model)(base[1:-1])
        base.sum().backward()
        results.append((base, model.w.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])


def test_a_branch_on_a_symbolic_size_is_guarded():
    # Fuzzer 20:1792: after sizes 3 and 5 made dimension 0 symbolic, `n % 2 == 0` was assumed
    # (the ShapeEnv's own guards were taken as axioms when dropping implied ones), so size 4 ran
    # the odd branch: float32 where eager gives float64.
    def f(a):
        t1 = a.sum(-1) + a.shape[0]
        if a.shape[0] % 2 == 0:
            return t1.to(torch.float64)
        return t1 / 2

    jf = keraunos.jit(f)
    for n in (3, 5, 4, 7, 6):
        a = torch.randn(n, 4)
        out, want = jf(a), f(a)
        assert out.dtype == want.dtype
        torch.testing.assert_close(out, want)
    assert keraunos.cache_misses(jf) == 3  # 3; 5 (symbolic, odd); 4 (symbolic, even)


def test_writing_a_parameter_through_a_detached_view_passed_in_is_refused_not_wrong():
    # Fuzzer 21:799: `d` is `model.w.detach()[:]`; one flat copy of their memory stood for both,
    # as a tensor that does not require grad, so w's gradient was lost. Refused now, with the
    # model and its parameter as they were.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, a, d):
            d.tanh_()
            return (self.w + a).clone()

    model = M()
    before = model.w.detach().clone()
    jm = keraunos.jit(model)
    with pytest.raises(keraunos.CaptureError, match="disagree on requires_grad"):
        jm(torch.randn(4), model.w.detach()[:])
    assert torch.equal(model.w.detach(), before) and model.w.grad is None
    a = torch.randn(4)
    torch.testing.assert_close(jm(a, torch.zeros(4)), model(a, torch.zeros(4)))


def test_one_tensor_passed_twice_to_a_program_writing_one_of_them_recompiles():
    # Fuzzer 30:1326: the entry compiled for separate tensors checked "the written input is
    # alone" by its storage's use count, which counts tensor objects: one tensor passed as both
    # arguments passed that check, and `a` did not see the write through `b`.
    class M(torch.nn.Module):
        def forward(self, a, b):
            b.t().mul_(2.0)
            return a.clone()

    model = M()
    jm = keraunos.jit(model)
    leaf = torch.randn(3, 4, requires_grad=True)
    jm(leaf.clone(), leaf.clone())
    got_in, want_in = leaf.clone(), leaf.clone()
    got, want = jm(got_in, got_in), model(want_in, want_in)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_in, want_in)
    got.sum().backward()
    leaf_grad_jit = leaf.grad.clone()
    leaf.grad = None
    want.sum().backward()
    torch.testing.assert_close(leaf_grad_jit, leaf.grad)


def test_repeated_rounding_casts_of_a_value_that_requires_grad_are_not_merged():
    """Fuzzer 53:1341: three `t1.to(bfloat16).float()` in a loop were merged into one by CSE;
    autograd then rounded the sum of their gradients to bfloat16 once, where eager rounds each
    gradient on its own: L.grad differed in the third digit."""
    def f(a):
        t1 = a.mean(-1, keepdim=True)
        t2 = a
        for _ in range(3):
            t2 = t2 * 0.5 + t1.to(torch.bfloat16).float()
        return (t2.sum(-1).to(torch.bfloat16).float() * (a.sum(-1) - 0.5).double()) * 1.5

    torch.manual_seed(547414)
    leaf = torch.randn(5, 4).requires_grad_()
    leaf_ref = leaf.detach().clone().requires_grad_()
    keraunos.jit(f)(leaf.clone()).sum().backward()
    f(leaf_ref.clone()).sum().backward()
    torch.testing.assert_close(leaf.grad, leaf_ref.grad, rtol=0, atol=0)
    # Without grad the casts are still merged: nothing rounds a gradient.
    jf = keraunos.jit(f)
    with torch.no_grad():
        torch.testing.assert_close(jf(leaf), f(leaf))
    casts = [b for b in keraunos.last_traces(jf)[-1].bound_symbols
             if getattr(b.symbol, "name", "") == "to"]
    assert len(casts) == 2  # t1's cast once, and the final sum's


def test_two_attention_calls_with_dropout_draw_twice_like_eager():
    """Found in review: attention with dropout (`dropout_p` > 0) was not tagged random in
    capture, so CSE merged two identical calls into one draw."""
    def f(q, k, v):
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        b = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        return a - b

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    torch.manual_seed(0)
    want = f(q, k, v)
    torch.manual_seed(0)
    got = keraunos.jit(f)(q, k, v)
    assert want.abs().sum() > 0  # two draws differ
    torch.testing.assert_close(got, want)



def test_fuzzer_72_380_is_eagers_cancellation_and_keraunos_gives_the_float64_gradient():
    """Fuzzer 72:380 reported a gradient mismatch that is eager's: the gradient of this program
    sums terms that cancel (`a - a` times values in the thousands), and eager's float32
    accumulation order loses the small term entirely (its L.grad is 0). keraunos's order keeps it:
    its float32 gradient is eager's float64 one."""
    def f(a):
        a.addcmul_(torch.einsum("nd,nd->", a, a), torch.einsum("nd,nd->", a, a), value=0.5)
        t3 = torch.bmm((-a).unsqueeze(0),
                       (a - a).t().unsqueeze(0) @ (a * a.sum(0)).unsqueeze(0))[0]
        s = t3.sum()
        t4 = (torch.maximum(s, s) + ((a.sum() / (s.abs() + 1.0)) > 0)) * torch.where(
            t3 > 0, torch.zeros(4, dtype=a.dtype), -0.5).norm().double()
        return t4, a

    def grad(fn, dtype):
        torch.manual_seed(783221)
        leaf = torch.randn(3, 8).to(dtype).requires_grad_()
        t4, a = fn(leaf.clone()[:, :4])
        (t4.sum() + a.sum()).backward()
        return leaf.grad

    exact = grad(f, torch.float64)
    assert exact.abs().max() > 100
    assert grad(f, torch.float32).abs().max() == 0  # eager, float32: the term is lost
    torch.testing.assert_close(grad(keraunos.jit(f), torch.float32), exact.float(),
                               rtol=1e-4, atol=1e-2)


def test_fused_equal_outputs_come_back_as_tensors_of_their_own():
    # Fuzzer with fusion, 91:144: `return t.clone(), t.clone()` in one region; Inductor found the
    # two outputs equal and handed back one buffer twice, so writing one changed the other.
    def f(a, b):
        t = b * 0.5 + a
        return t.clone(), t.clone()

    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    for _ in range(2):  # the first call finds the sharing, the later ones keep copying
        a, b = torch.randn(3, 4), torch.randn(3, 4)
        x, y = jitted(a, b)
        ex, ey = f(a, b)
        assert x is not y and x.untyped_storage()._cdata != y.untyped_storage()._cdata
        x.add_(1)
        assert torch.allclose(x, ex + 1, rtol=1e-4, atol=1e-4)
        assert torch.allclose(y, ey, rtol=1e-4, atol=1e-4)
    assert keraunos.last_fusions(jitted)


def test_fused_output_that_views_a_written_copy_of_an_input_keeps_the_write():
    # Fuzzer with fusion, 94:11: under autograd the written input is cloned and a region hands
    # back a view of the clone (AOTAutograd's wrapper remakes it as a view); copying that output
    # (taken for Inductor's equal-outputs buffer) or calling the graph past the wrapper lost the
    # write `b.mul_(...)` made through it, so `b` came back unchanged.
    def f(a, b):
        b.mul_(torch.nn.functional.relu(a.mean(-1, keepdim=True)))
        return b

    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    for _ in range(2):  # the first call decides the call path, the second takes it
        a = torch.randn(5, 4, requires_grad=True)
        b0 = torch.randn(4, 5)
        b, b_ref = b0.clone().t(), b0.clone().t()
        out, ref = jitted(a, b), f(a, b_ref)
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
        assert torch.allclose(b, b_ref, rtol=1e-4, atol=1e-4)
    assert keraunos.last_fusions(jitted)


def test_fused_clone_of_an_input_written_in_the_region_has_memory_of_its_own():
    # Fuzzer with fusion, 94:81: writes to `a` inside a region, then `a.clone()` returned:
    # for a transposed `a`, Inductor handed back the written input's own buffer as the clone.
    def f(a):
        a.abs_()
        a[0].mul_(-1.0)
        a.masked_fill_(a > 0.5, 0.0)
        return a.clone(), a

    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    for shape, transpose in (((3, 4), False), ((3, 4), False), ((4, 3), True), ((4, 3), True)):
        base = torch.randn(shape)
        a, a_ref = (base.clone().t(), base.clone().t()) if transpose else (base.clone(),
                                                                           base.clone())
        (c, out_a), (c_ref, _) = jitted(a), f(a_ref)
        assert out_a is a
        assert c.untyped_storage()._cdata != a.untyped_storage()._cdata
        assert torch.allclose(c, c_ref) and torch.allclose(a, a_ref)


def test_fused_writes_through_views_rebuilt_with_as_strided_stay_outside_regions():
    # Fuzzer with fusion, 95:704: `a` and its first row passed as two arguments are rebuilt from
    # one storage with as_strided; a region writing through those views and reading `a` again
    # gave values off by 1e33 (Inductor reads an as_strided view of a written input wrongly,
    # torch.compile alike). The writes now run outside the region.
    def f(a, d):
        d.sub_((a.sum()) + ((a.sum()) > 0))
        a.addcmul_((a) * (a).sum(0), (a) * (a).sum(0), value=0.5)
        return a

    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    for seed in (747095, 1):
        torch.manual_seed(seed)
        base = torch.randn(5, 4)
        a, a_ref = base.clone(), base.clone()
        with torch.no_grad():
            out, ref = jitted(a, a[0]), f(a_ref, a_ref[0])
        assert out is a and ref is a_ref
        torch.testing.assert_close(a, a_ref, rtol=1e-4, atol=1e-4)


def test_a_memory_written_twice_in_a_region_keeps_the_second_write_outside():
    # Fuzzer with fusion, 95:704 unshrunk: `a.index_put_(...)`, then `a.addcmul_(t, t)` with
    # `t = a * a.sum(0)`, in one region: Inductor's kernel read values of `a` it was writing
    # (torch.compile gives the same wrong values). A region now writes a memory once.
    idx = torch.tensor([0, 1])

    def f(a, d):
        a.index_put_((idx,), d * 1.5 + 0.25)
        t = a * a.sum(0)
        a.addcmul_(t, t, value=0.5)
        return a

    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    for _ in range(2):
        a0, d0 = torch.randn(3, 4), torch.randn(4)
        a, a_ref = a0.clone(), a0.clone()
        with torch.no_grad():
            assert jitted(a, d0) is a
            f(a_ref, d0)
        torch.testing.assert_close(a, a_ref, rtol=1e-4, atol=1e-4)
    regions = [b for b in keraunos.last_traces(jitted)[-1].bound_symbols
               if b.symbol.name.startswith("inductor_region")]
    assert regions and all(len([s for s in b.subsymbols if s.symbol.name.endswith("_")]) <= 1
                           for b in regions)


def _leaf_grads_over_calls(fn, makers):
    """Per call: the output, the written input and the leaf's gradient after backward."""
    results = []
    for make in makers:
        torch.manual_seed(0)
        leaf, *args = make()
        out = fn(*args)
        out[0].sum().backward()
        results.append((out[0].detach(), args[0].detach(), leaf.grad))
    return results


def _assert_same_calls(jitted, eager):
    for got, expected in zip(jitted, eager):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_issue_program_in_place_transposes_of_a_view_after_a_masked_write():
    # Issue 26 item 2: on the second call (a view at an offset of a larger storage, sizes made
    # symbolic) the leaf's gradient was off by 2 on some elements. On fakes, autograd replays
    # views from their view functions, which miss x0.t_(): the write x0[..., :1].neg_() got
    # the gradient of the untransposed slice.
    def f(x0, k0):
        v1 = torch.einsum('...i,...i->...', x0, x0); v2 = x0.t(); v3 = x0 / (k0.abs() + 1)
        v4 = v3.t()  # noqa: F841
        x0.masked_fill_(x0 > 0, 0.5); v5 = torch.arange(x0.shape[-1]); v6 = x0.amax(-1)
        for _ in range(2):
            v6 += v5.sum() * 0.1
        v7 = v5.unsqueeze(0); x0.t_(); v8 = v1 * x0; v9 = x0[..., :1].neg_()  # noqa: F841
        if v9.shape[0] > 2:
            x0.t_()
        return [v2]

    def dense():
        leaf = torch.randn(5, 4, requires_grad=True)
        return leaf, leaf * 1.0, torch.randn(5, 4)

    def view_at_an_offset():
        leaf = torch.randn(30, requires_grad=True)
        return leaf, (leaf * 1.0)[2:20].view(3, 6), torch.randn(3, 6)

    makers = [dense, view_at_an_offset]
    jitted = keraunos.jit(f)
    _assert_same_calls(_leaf_grads_over_calls(jitted, makers), _leaf_grads_over_calls(f, makers))
    assert keraunos.cache_misses(jitted) == 2


@pytest.mark.parametrize("change, write, undo", [
    ("t_()", "[..., :1].neg_()", "t_()"),
    ("transpose_(0, 1)", "[0].mul_(2.0)", "transpose_(0, 1)"),
    ("unsqueeze_(0)", "[:, 0].add_(1.0)", "squeeze_(0)"),
    ("swapdims_(0, 1)", "[1:].clamp_(-0.5, 0.5)", "swapdims_(0, 1)"),
])
def test_write_through_a_view_while_its_metadata_is_changed_in_place(change, write, undo):
    # Fuzzer 200:40, with the grammar's metadata round trips (METADATA_ROUND_TRIP).
    namespace = {}
    exec(f"def f(x):\n    y = x.t()\n    x.{change}\n    x{write}\n    x.{undo}\n"
         f"    return [y * 2]", namespace)
    f = namespace["f"]

    def sliced():
        leaf = torch.randn(6, 4, requires_grad=True)
        return leaf, (leaf * 1.0)[1:-1]

    def dense():
        leaf = torch.randn(3, 4, requires_grad=True)
        return leaf, leaf * 1.0

    makers = [sliced, dense]
    _assert_same_calls(_leaf_grads_over_calls(keraunos.jit(f), makers),
                       _leaf_grads_over_calls(f, makers))


def test_buffer_overwritten_with_a_value_requiring_grad_on_every_call():
    # Fuzzer 200:170: the second call's backward ran the first call's autograd node (reached
    # through the buffer, which the second call overwrote) with no gradient, and it read its
    # freed saved tensors: "Trying to backward through the graph a second time". Eager never
    # reaches the first call's graph: nothing of it flows into the loss.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(4))

        def forward(self, a):
            t = self.buf
            t.copy_(a.sum() * 0.5)
            a.tanh_()
            return a

    results = []
    for wrap in (lambda m: m, keraunos.jit):
        model = M()
        run = wrap(model)
        calls = []
        for n in (2, 3, 3):  # a new size recompiles; the last call hits
            torch.manual_seed(n)
            leaf = torch.randn(n, 4, requires_grad=True)
            out = run(leaf.clone())
            out.sum().backward()
            calls.append((out.detach(), model.buf.detach().clone(), leaf.grad))
        results.append(calls)
    _assert_same_calls(results[1], results[0])


def test_in_place_write_before_a_metadata_change_of_a_view_input_is_named():
    # Fuzzer 310:1017: `a.abs_()` then `a.unsqueeze_(0); a[:, 0].add_(1.0); a.squeeze_(0)` on a
    # transposed input: the autograd split lost the name of `a` as it was before its metadata
    # changed (UnboundLocalError in the forward).
    def f(a):
        a.abs_()
        a.unsqueeze_(0); a[:, 0].add_(1.0); a.squeeze_(0)  # noqa: E702
        return a * 2

    def transposed():
        leaf = torch.randn(4, 3, requires_grad=True)
        return leaf, (leaf * 1.0).t()

    makers = [transposed, transposed]
    keraunos_f = keraunos.jit(f)
    _assert_same_calls(_leaf_grads_over_calls(lambda a: [keraunos_f(a)], makers),
                       _leaf_grads_over_calls(lambda a: [f(a)], makers))


def test_write_through_a_view_of_a_metadata_changed_view_is_refused_not_an_internal_error():
    # Fuzzer 310:923: `t = a.select(0, 1); t.unsqueeze_(0); t[0, :1].neg_()`: the fake tensors
    # replay `t[0, :1]` without the unsqueeze_ and fail; eager runs it. A clear refusal.
    def f(a):
        t = a.select(0, 1)
        t.unsqueeze_(0); t[0, :1].neg_(); t.squeeze_(0)  # noqa: E702
        return a * 2

    with pytest.raises(keraunos.CaptureError, match="functional form"):
        keraunos.jit(f)(torch.randn(5, 4, requires_grad=True) * 1.0)


@pytest.mark.parametrize("aliased", [True, False], ids=["inputs-share-memory", "separate"])
def test_detached_alias_of_an_input_written_with_grad_and_returned_is_refused(aliased):
    # Fuzzer 322:1783: `t = a.detach(); t.sub_(b.mean(-1, keepdim=True)); return t`. In eager
    # t's history is its own (the write); keraunos rebuilt it as a view of the written input,
    # whose history is the input's: the gradient had the wrong sign with b = a.t(), and b got
    # no gradient at all without sharing. Now refused, with the way out.
    def f(a, b):
        t = a.detach()
        t.sub_(b.mean(-1, keepdim=True))
        return t

    leaf = torch.randn(4, 4, requires_grad=True)
    a = leaf.clone()
    b = a.t() if aliased else torch.randn(4, 4, requires_grad=True)
    with pytest.raises(keraunos.CaptureError, match=r"\.clone\(\)"):
        keraunos.jit(f)(a, b)
    g = lambda a, b: f(a, b).clone()  # noqa: E731 - the way out the message gives works
    torch.testing.assert_close(keraunos.jit(lambda a, b: f(a, b) * 1)(leaf.clone(), b.detach()),
                               g(leaf.clone(), b.detach()))


@pytest.mark.parametrize("fuse", ["wait", "off"])
def test_write_through_a_transposed_input_view_next_to_a_region_reaches_the_caller(fuse):
    # Fuzzer 1000:1857 (with fusion): `b.clamp_(min=0.0)` with b = b_base.t() requiring grad. The
    # program works on a flat copy of b's memory and views b from it; the copy's proxy did not
    # share the view's memory, so a region made the view and handed it back as a tensor of its
    # own, and the write went to that tensor, not to the copy: b_base kept its negative values.
    offset = torch.linspace(-1.0, 1.0, 4)

    def f(a, b):
        t2 = a + offset
        a.index_put_((torch.tensor([0, 1]),), t2.amax(0).to(a.dtype))
        b.clamp_(min=0.0)

    jitted = keraunos.jit(f, fuse=fuse)
    for seed in (0, 1):  # the compiling call, then the cached entry
        torch.manual_seed(seed)
        leaf_a, leaf_b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
        a, b_base = leaf_a.clone(), leaf_b.clone()
        a_eager, b_eager = leaf_a.clone(), leaf_b.clone()
        jitted(a, b_base.t())
        f(a_eager, b_eager.t())
        torch.testing.assert_close(b_base, b_eager)
        torch.testing.assert_close(a, a_eager)
        assert (b_base >= 0).all()
        (a.sum() + b_base.sum()).backward()
        grads = (leaf_a.grad.clone(), leaf_b.grad.clone())
        leaf_a.grad = leaf_b.grad = None
        (a_eager.sum() + b_eager.sum()).backward()
        torch.testing.assert_close(grads, (leaf_a.grad, leaf_b.grad))


class _WritesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, a):
        a.abs_()
        a[1:] = a.sum() * self.w
        a.index_put_((torch.tensor([1, 1]),), torch.full((4,), -3.0), accumulate=True)
        return a


def test_a_written_input_that_is_a_view_misses_an_entry_compiled_for_a_tensor_of_its_own():
    # Fuzz 82:860: under grad mode eager raises for a view of another tensor (autograd's
    # in-place rules) and not for a tensor of its own; the entry compiled for the latter served
    # the view without raising.
    torch.manual_seed(0)
    model = _WritesItsInput()
    jitted = keraunos.jit(model)
    out, want = jitted(torch.ones(3, 4)), model(torch.ones(3, 4))
    assert torch.equal(out, want)
    for run in (model, jitted):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            run(torch.ones(5, 4)[1:-1])
    reasons = keraunos.state_of(jitted).last_miss_reasons
    assert any("was a tensor of its own when compiled and is a view" in r for r in reasons), reasons
    # Under no_grad the two are alike: one entry serves both, as before.
    with torch.no_grad():
        for make in (lambda: torch.ones(3, 4), lambda: torch.ones(5, 4)[1:-1]):
            assert torch.equal(jitted(make()), model(make()))
