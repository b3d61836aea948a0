"""What the user's code keeps is left as eager leaves it. Capture runs the user's Python code on
fake tensors; none of them, and no other object of capture's, may stay in the module's
attributes, the dicts and lists it holds, caches filled on a first call; and a write the program
makes to the module's state is made as eager makes it (through ``.data``: without autograd). Each
test compares with eager on a deep copy, and looks at the user's state after every call."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.testing import assert_close

import keraunos
from keraunos.torch_internals.fake import FakeTensor


class BiasCache(nn.Module):
    """timm's LeViT, TinyViT and EfficientFormerV2 attention: in eval mode, the gathered
    attention biases are kept in a dict by device on the first call and read from it after."""

    def __init__(self):
        super().__init__()
        self.attention_biases = nn.Parameter(torch.randn(2, 9))
        self.register_buffer("attention_bias_idxs", torch.randint(0, 9, (4, 4)),
                             persistent=False)
        self.attention_bias_cache = {}

    def train(self, mode=True):
        super().train(mode)
        if mode and self.attention_bias_cache:
            self.attention_bias_cache = {}  # stale once the biases train
        return self

    def get_attention_biases(self, device):
        if self.training:
            return self.attention_biases[:, self.attention_bias_idxs]
        key = str(device)
        if key not in self.attention_bias_cache:
            self.attention_bias_cache[key] = self.attention_biases[:, self.attention_bias_idxs]
        return self.attention_bias_cache[key]

    def forward(self, x):
        return (x @ x.transpose(-1, -2)) + self.get_attention_biases(x.device)


def _no_fakes(container) -> None:
    values = container.values() if isinstance(container, dict) else container
    assert not any(isinstance(v, FakeTensor) for v in values), container


def test_a_dict_the_module_fills_on_its_first_call_holds_real_tensors():
    torch.manual_seed(0)
    model = BiasCache().eval()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model)
    for _ in range(3):
        x = torch.randn(2, 4, 4)
        with torch.no_grad():
            assert_close(jitted(x), eager(x))
        _no_fakes(model.attention_bias_cache)
        assert list(model.attention_bias_cache) == list(eager.attention_bias_cache)
        assert_close(model.attention_bias_cache["cpu"], eager.attention_bias_cache["cpu"])
    # the first call filled the dict (the epilogue wrote it), the second compiled for a full one
    assert keraunos.cache_misses(jitted) == 2 and keraunos.cache_hits(jitted) == 1
    model.train(), eager.train()
    x = torch.randn(2, 4, 4)
    jitted(x).sum().backward()
    eager(x).sum().backward()
    assert_close(model.attention_biases.grad, eager.attention_biases.grad)
    assert model.attention_bias_cache == {} == eager.attention_bias_cache


class Appends(nn.Module):
    """A list the module holds and appends to on each call (a history of activations)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.history = []

    def forward(self, x):
        y = self.fc(x)
        self.history.append(y.detach())
        return y * len(self.history)


def test_a_list_the_module_appends_to_holds_real_tensors():
    torch.manual_seed(0)
    model = Appends()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model)
    for _ in range(3):
        x = torch.randn(2, 4)
        with torch.no_grad():
            assert_close(jitted(x), eager(x))
        _no_fakes(model.history)
        assert len(model.history) == len(eager.history)
        for a, b in zip(model.history, eager.history):
            assert_close(a, b)


class ClampsItsWeight(nn.Module):
    """transformers' Gemma3n AltUp: in training, the coefficients are clipped in place through
    ``.data`` before use; autograd records nothing for that write."""

    def __init__(self):
        super().__init__()
        self.coefs = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        if self.training:
            self.coefs.weight.data.clamp_(-0.2, 0.2)
        return self.coefs(x).tanh()


def test_a_parameter_written_through_data_in_training_is_written_without_autograd():
    torch.manual_seed(0)
    model = ClampsItsWeight()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model)
    for _ in range(2):
        x = torch.randn(3, 4)
        out, ref = jitted(x), eager(x)
        assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        assert_close(model.coefs.weight, eager.coefs.weight)
        assert_close(model.coefs.weight.grad, eager.coefs.weight.grad)
        assert model.coefs.weight.is_leaf and model.coefs.weight.requires_grad
    assert keraunos.last_backward_traces(jitted)


class SwapsItsAttention(nn.Module):
    """transformers' BigBird: when a sequence is too short for block-sparse attention, the
    forward puts a full attention module in the tree in place of the sparse one, once."""

    def __init__(self):
        super().__init__()
        self.attention = nn.Linear(4, 4)
        self.kind = "block_sparse"

    def forward(self, x):
        if self.kind == "block_sparse" and x.shape[0] < 8:
            full = nn.Linear(4, 4)
            full.weight, full.bias = self.attention.weight, self.attention.bias
            self.attention = full
            self.kind = "original_full"
        return self.attention(x).relu() * (2 if self.kind == "original_full" else 1)


def test_a_module_the_program_puts_in_the_tree_is_put_there_by_an_eager_call():
    """The call that changes the tree runs eagerly (the change is made, for real, once); the
    next call is captured on the new tree, and later calls hit it."""
    torch.manual_seed(0)
    model = SwapsItsAttention()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model)
    for _ in range(3):
        x = torch.randn(3, 4)
        assert_close(jitted(x), eager(x))
    assert model.kind == "original_full" and type(model.attention) is nn.Linear
    assert keraunos.cache_misses(jitted) == 2 and keraunos.cache_hits(jitted) == 1
    assert "linear" in str(keraunos.last_traces(jitted)[-1])
