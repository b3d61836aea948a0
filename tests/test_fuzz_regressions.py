"""Regressions found by the differential fuzzer (keraunos.testing.fuzz), each compared with eager."""
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
