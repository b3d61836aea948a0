"""Symbolic sizes: one cache entry serves many sizes, and every call still gives eager's results.

``cache="symbolic values"`` makes every size and int argument a symbol from the first call on; the
default mode makes a size (or int) symbolic once it changed between calls (automatic dynamic).
Every test compares against eager PyTorch.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from helpers import litgpt_models
import keraunos
from keraunos.examples.gpt import GPT, GPTConfig


def counts(jitted):
    return keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)


def prologue_text(jitted) -> str:
    return "\n".join(str(t) for t in keraunos.last_prologue_traces(jitted))


def attention_like(x, w):
    q = x @ w
    scores = (q @ x.transpose(-1, -2)) / x.shape[-1] ** 0.5
    return scores.softmax(-1) @ x


# ----------------------------------------------------------------------------- entries
def test_twenty_sequence_lengths_compile_at_most_two_entries():
    jf = keraunos.jit(attention_like)
    w = torch.randn(64, 64)
    for n in range(2, 22):
        x = torch.randn(1, n, 64)
        assert_close(jf(x, w), attention_like(x, w))
    assert keraunos.cache_misses(jf) <= 2
    # A second sweep compiles nothing.
    misses = keraunos.cache_misses(jf)
    for n in range(2, 22):
        x = torch.randn(1, n, 64)
        assert_close(jf(x, w), attention_like(x, w))
    assert keraunos.cache_misses(jf) == misses


def test_symbolic_values_mode_compiles_one_entry_for_all_lengths():
    jf = keraunos.jit(attention_like, cache="symbolic values")
    w = torch.randn(64, 64)
    for n in (5, 9, 17, 33):
        x = torch.randn(1, n, 64)
        assert_close(jf(x, w), attention_like(x, w))
    assert counts(jf) == (1, 3)


def test_traces_print_symbolic_shapes():
    jf = keraunos.jit(attention_like)
    w = torch.randn(64, 64)
    jf(torch.randn(1, 23, 64), w)
    jf(torch.randn(1, 24, 64), w)
    text = str(keraunos.last_traces(jf)[-1])
    assert '"cpu f32[1, s0, 64]"' in text
    assert '"cpu f32[1, s0, s0]"' in text


def test_prologue_checks_guards_instead_of_exact_sizes():
    jf = keraunos.jit(lambda x: x.view(x.shape[0], -1, 8).sum(-1), cache="symbolic values")
    x = torch.randn(3, 40)
    assert_close(jf(x), x.view(3, -1, 8).sum(-1))
    text = prologue_text(jf)
    assert "2 <= s0" in text and "% (8*s0)) == 0" in text  # the view needs 8 | s1
    assert "s0 = x.shape[0]" in text and "x.stride() == (s1, 1)" in text
    assert "args[0]: 2 dimensions, torch.float32, cpu, requires_grad False" in text
    # A size the view cannot take fails the guard, and the new entry raises eager's error.
    y = torch.randn(3, 41)
    with pytest.raises(RuntimeError):
        y.view(3, -1, 8)
    with pytest.raises(RuntimeError):
        jf(y)


def test_a_decision_on_a_size_is_guarded_and_both_branches_give_eager_results():
    def f(x):
        if x.shape[0] > 6:
            return x.sum(0)
        return x.mean(0)
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (4, 5, 8, 9, 3):
        x = torch.randn(n, 4)
        assert_close(jf(x), f(x))
    assert keraunos.cache_misses(jf) == 2
    assert "s0 > 6" in prologue_text(jf) or "s0 <= 6" in prologue_text(jf) or \
        "7 <= s0" in prologue_text(jf) or "s0 <= 6" in prologue_text(jf)


# ------------------------------------------------------------------------- 0/1 sizes
def test_sizes_zero_and_one_are_specialized():
    f = lambda x: (x * 2).sum(0)  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (4, 1, 0, 7, 1, 0):
        x = torch.randn(n, 3)
        assert_close(jf(x), f(x))
    assert keraunos.cache_misses(jf) == 3  # one symbolic entry, one for 1, one for 0


def test_size_one_broadcasts_like_eager_after_a_symbolic_entry():
    f = lambda x, y: x + y  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    assert_close(jf(a, b), f(a, b))
    a, b = torch.randn(5, 3), torch.randn(1, 3)  # broadcasts: a separate entry
    assert_close(jf(a, b), f(a, b))


# ---------------------------------------------------------------------------- ints
def test_int_arguments_are_symbolic():
    f = lambda x, n: x[:, :n] * n  # noqa: E731
    jf = keraunos.jit(f)
    x = torch.randn(2, 40)
    for n in range(5, 30):
        assert_close(jf(x, n), f(x, n))
    assert keraunos.cache_misses(jf) <= 2
    assert "is an int" in prologue_text(jf)


def test_int_argument_returned_is_the_callers_value():
    f = lambda x, n: (x + n, n * 2)  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (3, 7):
        out, m = jf(torch.ones(2), n)
        assert_close(out, torch.ones(2) + n)
        assert m == n * 2 and type(m) is int


def test_size_returned_as_python_int_and_torch_size():
    f = lambda x: (x.shape[0] * 3, x.shape)  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (4, 6):
        x = torch.randn(n, 2)
        assert jf(x) == f(x)
        assert type(jf(x)[1]) is torch.Size


# --------------------------------------------------------------- automatic dynamic
def test_miss_reason_names_the_dimension_that_changed():
    jf = keraunos.jit(lambda x: x.relu())
    jf(torch.randn(2, 23))
    jf(torch.randn(2, 24))
    reasons = keraunos.last_cache_miss_reasons(jf)
    assert "args[0] dimension 1 changed 23 → 24; recompiled with it symbolic" in reasons
    x = torch.randn(2, 25)
    assert_close(jf(x), x.relu())
    assert counts(jf) == (2, 1)


def test_mark_dynamic_makes_the_first_entry_symbolic():
    jf = keraunos.jit(lambda x: x.cos())
    x = torch.randn(3, 8)
    keraunos.mark_dynamic(x, 1)
    assert_close(jf(x), x.cos())
    y = torch.randn(3, 11)
    assert_close(jf(y), y.cos())
    assert counts(jf) == (1, 1)
    assert "s0 = " in prologue_text(jf)


def test_mark_static_keeps_one_entry_per_size():
    jf = keraunos.jit(lambda x: x.sin())
    for n in (3, 4, 5):
        x = torch.randn(n)
        keraunos.mark_static(x, 0)
        assert_close(jf(x), x.sin())
    assert counts(jf) == (3, 0)


def test_dynamic_false_compiles_each_size():
    jf = keraunos.jit(lambda x: x.sin(), dynamic=False)
    for n in (3, 4, 5):
        x = torch.randn(n)
        assert_close(jf(x), x.sin())
    assert counts(jf) == (3, 0)


# -------------------------------------------------------------------------- autograd
def test_gradients_equal_eager_over_many_lengths():
    lin = torch.nn.Linear(16, 8)
    lin_ref = copy.deepcopy(lin)
    f = lambda m, x: F.gelu(m(x)).reshape(x.shape[0], -1).softmax(-1).sum()  # noqa: E731
    jf = keraunos.jit(lambda x: f(lin, x))
    for n in (3, 5, 8, 13):
        x = torch.randn(n, 2, 16, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, ref = jf(x), f(lin_ref, xr)
        assert_close(out, ref)
        out.backward()
        ref.backward()
        assert_close(x.grad, xr.grad)
        assert_close(lin.weight.grad, lin_ref.weight.grad)
    assert keraunos.cache_misses(jf) == 2
    backward = str(keraunos.last_backward_traces(jf)[-1])
    assert "s0" in backward


# ------------------------------------------------------------------------ effects
def test_in_place_write_to_a_symbolic_input_is_copied_back():
    def f(x):
        x.mul_(2)
        return x.sum(0)
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (4, 6):
        x = torch.randn(n, 3)
        xe = x.clone()
        assert_close(jf(x), f(xe))
        assert_close(x, xe)


def test_returned_view_of_a_symbolic_input_is_a_view_of_it():
    f = lambda x: x.t()[1:]  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (4, 6):
        x = torch.randn(n, 5)
        out = jf(x)
        assert_close(out, f(x))
        assert out._base is x or out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        out[0, 0] = 100.0
        assert x[0, 1] == 100.0


# ---------------------------------------------------------------------------- models
def test_example_gpt_over_several_sequence_lengths():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    model_ref = copy.deepcopy(model)
    jm = keraunos.jit(model)
    for t in (5, 9, 16, 23, 31):
        idx = torch.randint(0, GPTConfig().vocab_size, (2, t))
        out, ref = jm(idx), model_ref(idx)
        out = out[0] if isinstance(out, tuple) else out
        ref = ref[0] if isinstance(ref, tuple) else ref
        assert_close(out, ref)
    assert keraunos.cache_misses(jm) <= 2


def test_example_gpt_training_step_over_lengths():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    model_ref = copy.deepcopy(model)
    jm = keraunos.jit(model)
    for t in (6, 10, 14):
        idx = torch.randint(0, GPTConfig().vocab_size, (2, t))
        out, ref = jm(idx), model_ref(idx)
        out = out[0] if isinstance(out, tuple) else out
        ref = ref[0] if isinstance(ref, tuple) else ref
        out.square().mean().backward()
        ref.square().mean().backward()
        for (name, p), (_, pr) in zip(model.named_parameters(), model_ref.named_parameters()):
            assert_close(p.grad, pr.grad, msg=name)
    assert keraunos.cache_misses(jm) <= 2


LITGPT_PROMPTS = (7, 10, 13, 5, 16)


def _litgpt_models(block_size: int = 128):
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256, padded_vocab_size=256,
                           block_size=block_size)
    model, ref = litgpt_models(config, perturb=False)
    return model.eval(), ref.eval()


def _reset_kv_caches(*models):
    for m in models:
        m.max_seq_length = 64
        m.set_kv_cache(batch_size=1)


def test_litgpt_kv_cache_loop_with_growing_input_pos_maxp1():
    model, model_ref = _litgpt_models()
    jm = keraunos.jit(model)
    prefill_compiles = decode_compiles = 0
    with torch.no_grad():
        for prompt in LITGPT_PROMPTS:
            _reset_kv_caches(model, model_ref)
            idx = torch.randint(0, 256, (1, prompt))
            pos = torch.arange(prompt)
            before = keraunos.cache_misses(jm)
            out = jm(idx, input_pos=pos, input_pos_maxp1=prompt)
            prefill_compiles += keraunos.cache_misses(jm) - before
            assert_close(out, model_ref(idx, input_pos=pos, input_pos_maxp1=prompt))
            token = out[:, -1:].argmax(-1)
            before = keraunos.cache_misses(jm)
            for p in range(prompt, prompt + 24):
                ip = torch.tensor([p])
                out = jm(token, input_pos=ip, input_pos_maxp1=p + 1)
                assert_close(out, model_ref(token, input_pos=ip, input_pos_maxp1=p + 1))
                token = out[:, -1:].argmax(-1)
            decode_compiles += keraunos.cache_misses(jm) - before
            for (name, b), (_, br) in zip(model.named_buffers(), model_ref.named_buffers()):
                assert_close(b, br, msg=name)  # the KV caches the epilogue wrote
    # Prefill: one exact entry, then one symbolic; decode: the same (input_pos_maxp1 an int).
    assert prefill_compiles <= 2 and decode_compiles <= 2, (prefill_compiles, decode_compiles)


def test_litgpt_generate_gives_eager_tokens_with_two_prefill_and_two_decode_entries():
    from litgpt.generate.base import generate
    model, model_ref = _litgpt_models()
    jm = keraunos.jit(model)
    compiles = []
    for prompt in LITGPT_PROMPTS:
        _reset_kv_caches(model, model_ref)
        tokens = torch.randint(0, 256, (prompt,))
        before = keraunos.cache_misses(jm)
        out = generate(jm, tokens, prompt + 25, temperature=0.0, top_k=1)
        compiles.append(keraunos.cache_misses(jm) - before)
        assert out.tolist() == generate(model_ref, tokens, prompt + 25, temperature=0.0,
                                        top_k=1).tolist()
    # The prefill passes token.view(1, -1), a view: its length is a symbol too.
    assert sum(compiles) <= 4 and compiles[2:] == [0, 0, 0], compiles


def test_litgpt_sliding_window_generate_compiles_per_phase_not_per_position():
    # The ring buffer reads `input_pos.max().item()` and slices the cache by it while the window
    # is not full: with specialize_data=True that int is a symbol once it changed (each decode
    # step compiled an entry of its own before: 25 per prompt).
    from litgpt.generate.base import generate
    litgpt = pytest.importorskip("litgpt")
    from litgpt.model import GPT as LitGPT
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256, padded_vocab_size=256,
                           block_size=128, sliding_window_size=16)
    model = LitGPT(config).eval()
    model_ref = copy.deepcopy(model)
    assert all(block.attn.apply_sliding_window_attention for block in model.transformer.h)
    jm = keraunos.jit(model, specialize_data=True)
    compiles = []
    for prompt in LITGPT_PROMPTS:
        _reset_kv_caches(model, model_ref)
        tokens = torch.randint(0, 256, (prompt,))
        before = keraunos.cache_misses(jm)
        out = generate(jm, tokens, prompt + 25, temperature=0.0, top_k=1)  # the window fills
        compiles.append(keraunos.cache_misses(jm) - before)
        assert out.tolist() == generate(model_ref, tokens, prompt + 25, temperature=0.0,
                                        top_k=1).tolist()
        for (name, b), (_, br) in zip(model.named_buffers(), model_ref.named_buffers()):
            assert_close(b, br, msg=name)
    # Prefill: exact, then symbolic; decode: the window filling, then full.
    assert sum(compiles) <= 4 and compiles[2:] == [0, 0, 0], compiles


def test_memory_is_flat_over_300_decode_steps():
    # tracemalloc sees Python's allocations (not tensor storage, which the fixed-size KV cache
    # buffers hold): a cache hit that keeps anything per call (a reason, a trace, a closure)
    # grows it step by step. A test, not a benchmark mode, so that CI catches such a leak.
    import gc
    import tracemalloc
    model, _ = _litgpt_models(block_size=320)
    jm = keraunos.jit(model)
    model.max_seq_length = 320
    model.set_kv_cache(batch_size=1)
    token = torch.tensor([[3]])

    def step(p):
        with torch.no_grad():
            return jm(token, input_pos=torch.tensor([p]), input_pos_maxp1=p + 1)
    for p in range(10):  # compiles the decode entries
        step(p)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for p in range(10, 310):
            out = step(p)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert keraunos.cache_misses(jm) <= 2
    # Under one small tuple (56 bytes) a step: keeping any container per call fails this. (About
    # 10-25 bytes a step remain, allocated at the call line, not inside keraunos; an eager loop
    # grows by a few bytes a step too.)
    assert grown < 300 * 48, f"{grown} bytes over 300 steps"
    with torch.no_grad():  # and the last step still gives eager's logits
        assert_close(out, model(token, input_pos=torch.tensor([309]), input_pos_maxp1=310))


# ----------------------------------------------------- what compiles with exact sizes
def test_shape_changed_in_place_compiles_with_exact_sizes_and_says_why():
    def f(x):
        x.t_()
        return x * 2
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (3, 4):
        x, xe = torch.randn(n, 5), None
        xe = x.clone()
        assert_close(jf(x), f(xe))
        assert_close(x, xe)
        assert x.shape == xe.shape
    assert keraunos.cache_misses(jf) == 2  # exact sizes: one entry per size
    assert any("shape" in r for r in keraunos.state_of(jf).symbolic_fallbacks)


def test_view_input_keeps_exact_sizes_beside_symbolic_ones():
    f = lambda x, y: x * y.sum()  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    base = torch.randn(6, 6)
    for n in (3, 5):
        x, y = torch.randn(n, 6), base[1:4]
        assert_close(jf(x, y), f(x, y))
    assert keraunos.cache_misses(jf) == 1


def test_a_view_passed_in_has_symbolic_sizes():
    f = lambda x, y: x * 2 + y  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (3, 5, 7):
        x, y = torch.randn(10, 8)[1:n + 1, ::2], torch.randn(n, 4)
        assert_close(jf(x, y), f(x, y))
    assert keraunos.cache_misses(jf) == 1
    assert "x.storage_offset()" in prologue_text(jf) or "x.stride(" in prologue_text(jf)


def test_a_view_beside_its_written_base_reads_what_eager_reads():
    def f(base, v):
        base.add_(1)
        return v * 2
    jf = keraunos.jit(f, cache="symbolic values")
    for n in (4, 6, 9):
        base = torch.randn(n, 3)
        base_ref = base.clone()
        out, ref = jf(base, base[1:]), f(base_ref, base_ref[1:])
        assert_close(out, ref)
        assert_close(base, base_ref)


def test_other_rank_or_type_is_a_miss_not_an_error():
    f = lambda x: x + 1  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    x2 = torch.randn(3, 4)
    assert_close(jf(x2), f(x2))
    x3 = torch.randn(2, 3, 4)
    assert_close(jf(x3), f(x3))
    assert jf(5) == f(5)
    assert keraunos.cache_misses(jf) == 3
    assert any("3 dimensions" in r or "2 dimensions" in r
               for r in keraunos.last_cache_miss_reasons(jf))


def test_symbolic_int_and_float_arguments_keep_their_types():
    f = lambda x, n, scale: x.repeat(n, 1) * scale  # noqa: E731
    jf = keraunos.jit(f, cache="symbolic values")
    x = torch.randn(2, 3)
    for n, scale in ((2, 0.5), (3, 0.5), (4, 0.5), (3, 2.0)):
        assert_close(jf(x, n, scale), f(x, n, scale))
    assert keraunos.cache_misses(jf) == 2  # a new float value is a new entry


# ------------------------------------------------------- mutable objects as inputs (a KV cache)
class _Layer:
    def __init__(self):
        self.keys = None
        self.is_initialized = False


class _Cache:
    """A cache object in the style of Hugging Face's DynamicCache: a list of layers that grows on
    the first call, tensors that grow by concatenation, a plain step counter."""

    def __init__(self):
        self.layers = []
        self.steps = 0

    def update(self, k, i):
        while len(self.layers) <= i:
            self.layers.append(_Layer())
        layer = self.layers[i]
        if not layer.is_initialized:
            layer.keys = k
            layer.is_initialized = True
        else:
            layer.keys = torch.cat([layer.keys, k], dim=-2)
        return layer.keys


def _decode(x, cache):
    out = x
    for i in range(2):
        k = cache.update(out * (i + 1), i)
        out = out + k.sum(-2, keepdim=True)
    cache.steps = cache.steps + 1
    return out


def test_object_passed_in_is_left_as_eager_leaves_it_and_growing_tensors_are_symbolic():
    jf = keraunos.jit(_decode)
    cache, cache_ref = _Cache(), _Cache()
    for step in range(10):
        x = torch.randn(1, 3 if step == 0 else 1, 4)
        assert_close(jf(x, cache), _decode(x, cache_ref))
        assert cache.steps == cache_ref.steps and len(cache.layers) == len(cache_ref.layers)
        for layer, layer_ref in zip(cache.layers, cache_ref.layers):
            assert type(layer) is _Layer and layer.is_initialized == layer_ref.is_initialized
            assert_close(layer.keys, layer_ref.keys)
    assert keraunos.cache_misses(jf) <= 3  # first call, then the counter and lengths symbolic
    epilogue = str(keraunos.last_epilogue_traces(jf)[-1])
    assert ".keys = " in epilogue and ".steps = " in epilogue


def test_object_passed_in_with_an_attribute_read_that_is_absent_is_guarded():
    class Box:
        pass
    f = lambda x, box: x * getattr(box, "scale", 2.0)  # noqa: E731
    jf = keraunos.jit(f)
    box = Box()
    x = torch.randn(3)
    assert_close(jf(x, box), f(x, box))
    box.scale = 5.0
    assert_close(jf(x, box), f(x, box))
    assert keraunos.cache_misses(jf) == 2


HF_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _hf_model(kind: str, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                         n_positions=128)
    else:
        config = transformers.AutoConfig.for_model(kind, **HF_TINY, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model, copy.deepcopy(model)


def _generate_compiles(model, model_ref, counted, generate, prompts, **options):
    """Compilations per ``generate`` call, each checked to give eager's greedy tokens."""
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, **options}
    compiles = []
    for prompt in prompts:
        ids = torch.randint(1, 128, (1, prompt))
        before = keraunos.cache_misses(counted)
        with torch.no_grad():
            out = generate(ids, attention_mask=torch.ones_like(ids), **options)
            ref = model_ref.generate(ids, attention_mask=torch.ones_like(ids), **options)
        assert out.tolist() == ref.tolist()
        compiles.append(keraunos.cache_misses(counted) - before)
    return compiles


HF_KINDS = ["llama", "gpt2", "qwen2", "mistral"]


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_what_generate_varies_is_found_under_either_name_of_the_cache_keyword(keyword):
    """transformers 5.2x renamed the forward's cache keyword ``past_key_values`` to ``cache``:
    under either, the cache's tensors vary in their sequence dimension and its ints (a layer's
    ``cumulative_length``) vary, so that a later prompt length compiles nothing."""
    from keraunos.core.provenance import ATTR, ITEM, Path, root
    from keraunos.integrations import huggingface
    layer = Path(Path(Path(Path(root("kwargs"), ITEM, keyword), ATTR, "layers"), ITEM, 0),
                 ATTR, "keys")
    length = Path(layer.parent, ATTR, "cumulative_length")
    assert huggingface.varying_dims(layer, 4) == {2}
    assert huggingface.varies_int(length)
    other = Path(Path(root("kwargs"), ITEM, "labels"), ATTR, "keys")
    assert huggingface.varying_dims(other, 4) == set() and not huggingface.varies_int(other)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_generate_with_the_default_dynamic_cache(kind):
    model, model_ref = _hf_model(kind)
    model.forward = keraunos.jit(model.forward)
    compiles = _generate_compiles(model, model_ref, model.forward, model.generate, (7, 11, 5))
    # Prefill (its sequence dimension symbolic: generate varies it), the first decode step, the
    # decode steps with the cache length symbolic; other prompt lengths compile nothing.
    assert compiles[0] <= 3 and compiles[1:] == [0, 0], compiles
    assert keraunos.cache_hits(model.forward) > 0


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_generate_with_a_static_cache(kind):
    model, model_ref = _hf_model(kind)
    model.forward = keraunos.jit(model.forward)
    compiles = _generate_compiles(model, model_ref, model.forward, model.generate, (7, 11),
                                  cache_implementation="static")
    assert compiles[0] <= 3 and compiles[1] == 0, compiles


def test_hf_generate_with_fusion_compiles_as_few_entries_as_without():
    """The fused symbolic entries serve every decode step. An input's size symbol that the
    ShapeEnv found equal to another (cache_position's length and input_ids': s98 -> s27) gave a
    KeyError in the region's graph, so every step fell back to exact sizes and recompiled."""
    model, model_ref = _hf_model("llama")
    jitted = keraunos.jit(model, executors=["inductor", "torch"], fuse="wait")
    compiles = _generate_compiles(model, model_ref, jitted, jitted.generate, (7, 11))
    assert compiles[0] <= 3 and compiles[1] == 0, compiles
    assert keraunos.last_fusions(jitted), "the decode entry has fused regions"
    assert not jitted._keraunos.symbolic_fallbacks


def test_hf_generate_with_static_cache_and_fusion_writes_the_cache_inside_regions():
    """StaticCache writes each layer's keys and values with ``index_copy_``: with fusion the
    writes run inside the layer's region; tokens are eager's (``_generate_compiles`` compares
    them), and no more entries compile than without fusion."""
    model, model_ref = _hf_model("llama")
    jitted = keraunos.jit(model, executors=["inductor", "torch"], fuse="wait")
    compiles = _generate_compiles(model, model_ref, jitted, jitted.generate, (7, 11),
                                  cache_implementation="static")
    assert compiles[0] <= 3 and compiles[1] == 0, compiles
    regions = keraunos.last_fusions(jitted)
    assert any("index_copy_" in [b.symbol.name for b in r.lines] and r.written for r in regions)


def test_hf_generate_mistral_sliding_window_does_not_compile_per_position():
    # A window of 6 fills during the prompt; every decode step slides it (the cache keeps a view
    # of the last 5 positions, whose offset and strides are symbols).
    model, model_ref = _hf_model("mistral", sliding_window=6)
    model.forward = keraunos.jit(model.forward)
    compiles = _generate_compiles(model, model_ref, model.forward, model.generate, (7, 11),
                                  max_new_tokens=8)
    assert compiles[0] <= 3 and compiles[1] == 0, compiles


def test_hf_generate_of_the_jitted_module_runs_the_compiled_forward():
    model, model_ref = _hf_model("llama")
    jm = keraunos.jit(model)
    compiles = _generate_compiles(model, model_ref, jm, jm.generate, (7, 11))
    assert compiles[0] >= 1 and compiles[1] == 0, compiles
    assert keraunos.cache_hits(jm) >= 10  # every decode step ran the compiled program
    assert "forward" not in model.__dict__  # generate left the module as it was


def test_a_conjugated_view_passed_in_keeps_its_conjugate_bit():
    """Found in review: a view given symbolic sizes was rebuilt with `set_`, which drops the
    conjugate bit; `x.is_conj()` was baked in as False on the symbolic entry."""
    def f(x):
        return x * 2 if x.is_conj() else x * 3
    jf = keraunos.jit(f)
    for n in (3, 4, 5):
        x = torch.randn(6, 6, dtype=torch.cfloat)[:, :n].conj()
        torch.testing.assert_close(jf(x), f(x))


class _Generates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)

    def generate(self, x, steps=3):
        for _ in range(steps):
            x = self(x)
        return x


def test_generate_of_a_jitted_module_with_hooks_runs_them_once_and_says_it_runs_eagerly():
    """Found in review: the compiled program already runs the module's hooks, and generate's
    call of the module ran them again around it."""
    model = _Generates()
    model.register_forward_hook(lambda mod, args, out: out + 100)
    jm = keraunos.jit(model)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="generate runs eagerly"):
        torch.testing.assert_close(jm.generate(x), model.generate(x))


def test_generate_from_threads_at_once_leaves_the_original_forward_alone():
    import threading
    model = _Generates()
    jm = keraunos.jit(model)
    x = torch.randn(2, 4)
    want = model.generate(x)
    results, start = [], threading.Barrier(4)

    def run():
        start.wait()
        for _ in range(20):
            results.append(jm.generate(x))
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80
    for r in results:
        torch.testing.assert_close(r, want)
    assert "forward" not in model.__dict__  # the routing is gone once every generate returned
    assert keraunos.cache_hits(jm) > 0
