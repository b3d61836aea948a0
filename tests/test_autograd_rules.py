"""Our own derivative rules (keraunos/autograd/rules.py) against PyTorch's."""
import copy

import torch
import torch.nn as nn

from helpers import check_grads
import keraunos


def test_layer_norm_rule_keeps_the_forward_readable_and_saves_less():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    jm = check_grads(model, x, ref=ref, loss=lambda out: out.square().sum())
    forward = str(keraunos.last_traces(jm)[-1])
    assert "torch.nn.functional.layer_norm(" in forward
    assert "native_layer_norm" not in forward  # no ATen lowering to hand over mean and rstd
    backward = keraunos.last_backward_traces(jm)[-1]
    assert "native_layer_norm_backward" in str(backward)
    # mean and rstd are recomputed in the backward, not saved: fewer tensors kept than eager
    counts = {}
    for name, run in (("eager", ref), ("keraunos", jm)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            run(x)
        counts[name] = len({t.untyped_storage().data_ptr() for t in saved})
    assert counts["keraunos"] < counts["eager"], counts


def test_layer_norm_rule_without_affine_parameters():
    def f(x):
        return torch.nn.functional.layer_norm(x, (6,)).exp().sum()
    check_grads(f, torch.randn(3, 6, requires_grad=True))


def test_rules_are_keyed_by_the_op_object_not_its_printed_name():
    from keraunos.autograd.rules import DERIVATIVE_RULES, derivative_rule, rule_for
    assert torch.nn.functional.layer_norm in DERIVATIVE_RULES
    assert all(not isinstance(op, str) for op in DERIVATIVE_RULES)
    assert rule_for(torch.exp) is torch.exp  # no rule: the op itself
    try:
        derivative_rule(torch.nn.functional.layer_norm)(lambda *a: None)
    except ValueError as error:
        assert "already registered" in str(error)
    else:
        raise AssertionError("registering a second rule for one op must fail")
