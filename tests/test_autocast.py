"""Reduced precision: programs run under ``torch.autocast`` (capture writes autocast's casts as
lines of the trace, ``capture/recorder.py``, so the fused program computes what eager computes
under autocast), and models whose weights are bfloat16 or float16.

Values are judged as the fuzzer judges reduced precision: against a float64 run of the same
program, keraunos's distance at most a small multiple of eager autocast's own (a fused region
rounds pointwise math once, where eager rounds each op to bfloat16)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import keraunos
from keraunos.core.tags import UNDER_AUTOCAST
from keraunos.runtime.call import state_of

from helpers import VOCAB, litgpt_models

DTYPES = [torch.bfloat16, torch.float16]


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).square().mean().sqrt().item()


def assert_as_close_to_float64(got, eager, exact, what: str = "", factor: float = 3.0):
    """``got`` is at most ``factor`` times eager's distance from the float64 result (plus the
    float32 rounding of a value that eager gets exactly)."""
    tiny = 1e-6 * max(exact.double().abs().max().item(), 1.0)
    assert _distance(got, exact) <= factor * _distance(eager, exact) + tiny, (
        f"{what}: keraunos {_distance(got, exact):.3g}, eager {_distance(eager, exact):.3g} "
        f"from float64")


class Block(nn.Module):
    """A transformer-like block: linear, GELU, LayerNorm, a residual, a convolution."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.conv = nn.Conv1d(32, 32, 3, padding=1)

    def forward(self, x):
        h = self.norm(x + self.down(F.gelu(self.up(x))))
        return self.conv(h.transpose(1, 2)).transpose(1, 2).softmax(-1)


def _fused_lines(trace):
    return [b for b in trace.bound_symbols if b.symbol.name.startswith("inductor_region")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inference_under_autocast_is_fused_with_the_casts_as_lines(dtype):
    torch.manual_seed(0)
    model = Block().eval()
    jitted = keraunos.jit(copy.deepcopy(model), fuse="wait")
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        exact = model.double()(x.double())
        model.float()
        for _ in range(2):
            with torch.autocast("cpu", dtype=dtype):
                got, eager = jitted(x), model(x)
    assert got.dtype == eager.dtype
    assert_as_close_to_float64(got, eager, exact, "output")
    stats = keraunos.compile_stats(jitted)
    assert stats.tier == "fused", stats
    trace = keraunos.last_traces(jitted)[-1]
    assert _fused_lines(trace)
    casts = [b for line in _fused_lines(trace) for b in line.subsymbols
             if "_to_copy" in b.symbol.name and b.kwargs.get("dtype") is dtype]
    assert len(casts) >= 3  # the input and each linear's weight and bias, where eager casts them
    assert not [b for b in trace.bound_symbols if UNDER_AUTOCAST in b.tags]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_steps_under_autocast_are_fused_and_match_eager(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Flatten(), nn.Linear(8 * 32, 4))
    reference, exact_model = copy.deepcopy(model), copy.deepcopy(model).double()
    jitted = keraunos.jit(model, fuse="wait")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3)
                  for m in (model, reference, exact_model)]
    for step in range(3):
        x, y = torch.randn(4, 8, 32), torch.randint(0, 4, (4,))
        for m, run, opt in zip((model, reference, exact_model), (jitted, reference, exact_model),
                               optimizers):
            opt.zero_grad(set_to_none=True)
            if m is exact_model:
                loss = F.cross_entropy(run(x.double()), y)
            else:
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.cross_entropy(run(x), y)
            loss.backward()
            if step == 2:  # the gradients of the fused program, before its last update
                grads = getattr(m, "_grads", {})
                m._grads = {n: p.grad.clone() for n, p in m.named_parameters()}
            opt.step()
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert _fused_lines(keraunos.last_backward_traces(jitted)[-1])
    for name, exact in exact_model._grads.items():
        assert_as_close_to_float64(model._grads[name], reference._grads[name], exact, name)
    for (name, p), q, e in zip(model.named_parameters(), reference.parameters(),
                               exact_model.parameters()):
        assert_as_close_to_float64(p, q, e, f"{name} after 3 steps")
    del grads


def test_the_background_tier_fuses_under_autocast():
    torch.manual_seed(0)
    model = Block().eval()
    jitted = keraunos.jit(copy.deepcopy(model), fuse="background")  # (the default outside tests)
    x = torch.randn(2, 8, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first, eager = jitted(x), model(x)
        assert keraunos.wait_for_fusion(jitted, timeout=300)
        fused = jitted(x)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert_close(first, eager)  # tier 0: eager's kernels, eager's casts
    assert_as_close_to_float64(fused, eager, exact, "fused output")


def test_an_op_autocast_changes_inside_stays_one_line_outside_regions():
    # einsum is not on autocast's lists; its inner bmm is, so autocast casts values made inside
    # it: the line runs where autocast is on. SDPA's casts are of its inputs: lines, then the op
    # (its fused CPU kernel, eager's), on the cast values.
    def f(x, w):
        a = F.scaled_dot_product_attention(x, x, x)
        return torch.einsum("bij,jk->bik", a, w).relu() * 2 + 1

    x, w = torch.randn(2, 8, 16), torch.randn(16, 16)
    jitted = keraunos.jit(f, fuse="wait")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, eager = jitted(x, w), f(x, w)
    assert_close(got, eager, rtol=0, atol=0)
    trace = keraunos.last_traces(jitted)[-1]
    tagged = [b.symbol.name for b in trace.bound_symbols if UNDER_AUTOCAST in b.tags]
    assert tagged == ["torch.einsum"]
    inside = [b.symbol.name for line in _fused_lines(trace) for b in line.subsymbols]
    names = [b.symbol.name for b in trace.bound_symbols] + inside
    sdpa = names.index("torch.nn.functional.scaled_dot_product_attention")
    assert "_to_copy" in names[sdpa - 1]  # one cast: x, passed three times
    assert "torch.einsum" not in inside


def test_a_changed_autocast_dtype_compiles_again():
    torch.manual_seed(0)
    model = Block().eval()
    jitted = keraunos.jit(model, fuse="off")
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
            with torch.autocast("cpu", dtype=dtype):
                got = jitted(x)
                assert got.dtype == dtype
                assert_close(got, model(x), rtol=0, atol=0)
    assert keraunos.cache_misses(jitted) == 2


def test_autocast_disabled_inside_the_program_keeps_float32_there_with_a_backward_trace():
    def f(x, w1, w2):
        h = x @ w1  # bfloat16 under the caller's autocast
        with torch.autocast("cpu", enabled=False):
            g = h.float() @ w2  # float32
        return g.sum(), h

    x = torch.randn(4, 8)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    r1, r2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    jitted = keraunos.jit(f, fuse="wait")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (loss, h), (ref_loss, ref_h) = jitted(x, w1, w2), f(x, r1, r2)
    assert h.dtype == ref_h.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert_close(loss, ref_loss, rtol=0, atol=0)
    loss.backward()
    ref_loss.backward()
    assert_close(w1.grad, r1.grad, rtol=0, atol=0)
    assert_close(w2.grad, r2.grad, rtol=0, atol=0)
    assert keraunos.last_backward_traces(jitted)


def test_litgpt_training_step_under_autocast_matches_eager():
    Config = pytest.importorskip("litgpt").Config
    config = Config.from_name("Llama-2-7b-hf", n_layer=2, n_embd=64, n_head=4, n_query_groups=4,
                              head_size=16, intermediate_size=176, vocab_size=VOCAB,
                              padded_vocab_size=VOCAB, block_size=64)
    model, reference = litgpt_models(config)
    exact_model = copy.deepcopy(reference).double()
    jitted = keraunos.jit(model, fuse="wait")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)

    def loss_of(logits):
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, ref_loss = loss_of(jitted(x)), loss_of(reference(x))
        loss.backward()
        ref_loss.backward()
    exact_loss = loss_of(exact_model(x))
    exact_loss.backward()
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert_as_close_to_float64(loss.detach(), ref_loss.detach(), exact_loss.detach(), "loss")
    for (name, p), q, e in zip(model.named_parameters(), reference.parameters(),
                               exact_model.parameters()):
        assert_as_close_to_float64(p.grad, q.grad, e.grad, name)
    assert keraunos.cache_misses(jitted) == 1 and state_of(jitted).entries


def test_transformers_model_under_autocast_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    exact_model = copy.deepcopy(model).double()
    jitted = keraunos.jit(copy.deepcopy(model), fuse="wait")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            jitted(input_ids=ids)
            got, eager = jitted(input_ids=ids).logits, model(input_ids=ids).logits
        exact = exact_model(input_ids=ids).logits
    assert got.dtype == eager.dtype
    assert_as_close_to_float64(got, eager, exact, "logits")
    assert keraunos.compile_stats(jitted).tier == "fused"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_reduced_precision_model_trains_fused_as_close_to_float64_as_eager(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Flatten(), nn.Linear(8 * 32, 4))
    exact_model = copy.deepcopy(model).double()
    model, reference = model.to(dtype), copy.deepcopy(model).to(dtype)
    jitted = keraunos.jit(model, fuse="wait")
    x, y = torch.randn(4, 8, 32), torch.randint(0, 4, (4,))
    for m, run, inputs in ((model, jitted, x.to(dtype)), (model, jitted, x.to(dtype)),
                           (reference, reference, x.to(dtype)),
                           (exact_model, exact_model, x.double())):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(run(inputs).double(), y).backward()
    assert keraunos.compile_stats(jitted).tier == "fused"
    assert _fused_lines(keraunos.last_backward_traces(jitted)[-1])
    for (name, p), q, e in zip(model.named_parameters(), reference.parameters(),
                               exact_model.parameters()):
        assert p.grad.dtype == dtype
        assert_as_close_to_float64(p.grad, q.grad, e.grad, name)


def test_a_float16_training_step_with_a_grad_scaler_trains_like_eager():
    """The recipe of float16 training: autocast to float16, the loss scaled by a ``GradScaler``
    (its unscaling, inf checks and step outside the jitted model), fused."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Flatten(), nn.Linear(8 * 32, 4))
    reference = copy.deepcopy(model)
    jitted = keraunos.jit(model, fuse="wait")
    sides = []
    for m, run in ((model, jitted), (reference, reference)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        sides.append((m, run, optimizer, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)))
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(4, 8, 32, generator=g), torch.randint(0, 4, (4,), generator=g)
        losses = []
        for m, run, optimizer, scaler in sides:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(run(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach())
        assert_close(losses[0], losses[1], rtol=2e-3, atol=2e-3)
    assert sides[0][3].get_scale() == sides[1][3].get_scale()
    assert keraunos.compile_stats(jitted).tier == "fused"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, q, rtol=2e-3, atol=2e-3, msg=name)
