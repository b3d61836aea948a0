"""The backward split at DDP's bucket boundaries, in one process: the chain of autograd nodes
gives eager's gradients in the ways a backward can be asked for.

Under DistributedDataParallel (tests/test_distributed.py, 2 gloo ranks) the pipeline reads the
bucket sizes of the DDP module whose forward is running; here ``active_ddp_bucket_caps``
is replaced by buckets of one byte, so that every gradient closes a bucket and the backward is
as many nodes as it can be.
"""
import pytest
import torch

import keraunos
from keraunos.runtime import keeping, pipeline
from keraunos.autograd.buckets import BucketCaps
from keraunos.autograd.function import _FirstNode, _MiddleNode, _OutputNode

from helpers import assert_grads_match


@pytest.fixture
def tiny_buckets(monkeypatch):
    # What capture reads, and what the program store's key reads (such a program is not kept).
    for module in (pipeline, keeping):
        monkeypatch.setattr(module, "active_ddp_bucket_caps", lambda: BucketCaps(1, 1))


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 3)
        self.aux = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), self.aux(h), self.head.weight.t()


def _nodes(tensor) -> list[str]:
    """The keraunos nodes of ``tensor``'s autograd graph, by kind."""
    kinds = {_FirstNode._backward_cls: "first", _MiddleNode._backward_cls: "middle",
             _OutputNode._backward_cls: "output"}
    seen, stack, found = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) in kinds:
            found.append(kinds[type(node)])
        stack.extend(f for f, _ in node.next_functions)
    return sorted(found)


def _pair():
    eager = TwoHeads()
    mine = TwoHeads()
    return eager, mine, keraunos.jit(mine)


def test_backward_is_a_chain_of_nodes_and_gives_eagers_gradients(tiny_buckets):
    eager, mine, jm = _pair()
    x = torch.randn(4, 6)
    out = jm(x)
    nodes = _nodes(out[0])
    assert nodes.count("output") == nodes.count("first") == 1 and nodes.count("middle") >= 2
    (out[0].sum() + out[1].pow(2).sum() + out[2].sum()).backward()
    e = eager(x)
    (e[0].sum() + e[1].pow(2).sum() + e[2].sum()).backward()
    assert_grads_match(mine, eager, require_all=True)
    assert "DDP bucket boundary" in str(keraunos.last_backward_traces(jm)[-1])


def test_an_output_the_loss_ignores_leaves_its_only_inputs_without_gradient(tiny_buckets):
    # aux's parameters are reached only from the second output: None, as in eager.
    eager, mine, jm = _pair()
    x = torch.randn(4, 6)
    jm(x)[0].sum().backward()
    eager(x)[0].sum().backward()
    assert mine.aux.weight.grad is None and eager.aux.weight.grad is None
    assert_grads_match(mine, eager, require_all=False)


def test_retained_graph_backward_twice_accumulates_as_eager(tiny_buckets):
    eager, mine, jm = _pair()
    x = torch.randn(4, 6)
    for model in (jm, eager):
        loss = model(x)[0].pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads_match(mine, eager)  # aux gets none: the loss does not reach it


def test_grad_of_some_parameters_only_matches_eager(tiny_buckets):
    eager, mine, jm = _pair()
    x = torch.randn(4, 6, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    wanted = [mine.body[0].weight, mine.head.bias, x]
    got = torch.autograd.grad(jm(x)[0].sum(), wanted)
    want = torch.autograd.grad(eager(x_eager)[0].sum(),
                               [eager.body[0].weight, eager.head.bias, x_eager])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_without_ddp_the_backward_is_one_node():
    eager, mine, jm = _pair()
    out = jm(torch.randn(4, 6))
    assert _nodes(out[0]) == []
    assert "DDP bucket boundary" not in str(keraunos.last_backward_traces(jm)[-1])
