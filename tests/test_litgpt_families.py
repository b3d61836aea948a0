"""keraunos on litgpt's ``GPT``: the config families that tests/test_litgpt.py does not cover.

Gemma (1, 2 and 3), Mistral, Phi-2 and Qwen2.5: each family's config is the real litgpt config of a
released model (``Config.from_name``) shrunk to 2 layers, n_embd 64, vocab 256 and block_size 64,
with n_head / n_query_groups / head_size kept consistent and the family's query-group structure kept
(MQA stays MQA, GQA stays GQA). Every other architectural switch keeps its real value: embedding
scaling, GemmaMLP, RMSNorm with unit offset, attention and final-logit softcapping, post-attention and
post-MLP norms, attention_scores_scalar, QK norm, local/global RoPE bases, attention biases, partial
rotary, shared attention norm, lm_head bias. Two sizes shrink with the block: a sliding window of 4096
(Mistral, Gemma 2) or 512 (Gemma 3) could never mask anything in a 64-token block, so it becomes 8,
shorter than the 12-token inputs. Weights are random (norm weights and biases too); nothing is
downloaded.

For every family, against an identical deep copy run eagerly:

* forward logits, and a cache hit for a second call with the same shapes;
* training: train mode, ``cross_entropy(logits, targets).backward()``: loss and every parameter's
  gradient, and a second step on the cached program;
* KV-cache generation (``set_kv_cache(batch_size=2, max_seq_length=32)``, eval, no_grad, a prefill
  with ``input_pos=arange(P)`` and 4 single-token decode steps with ``input_pos=tensor([pos])``):
  logits at every step and every buffer afterwards.

litgpt's sliding-window KV cache (a ring buffer) calls ``input_pos.max().item()`` to decide how much
of the cache to return: control flow on tensor data. By default keraunos refuses it with a
``CaptureError`` (tested); with ``keraunos.jit(model, specialize_data=True)`` the prologue computes
the value and checks it (as a size symbol once it changes), and generation matches eager (tested). The same
families also run generation with the window switched off.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import keraunos
from helpers import VOCAB, assert_grads_match, check_grads, litgpt_models, tokens
from keraunos import CaptureError

litgpt = pytest.importorskip("litgpt")
from litgpt import Config  # noqa: E402
from litgpt.model import GPT  # noqa: E402

# (the message regex cannot contain ":", the separator of warning filters, hence the ".")
pytestmark = pytest.mark.filterwarnings("error:keraunos. no backward trace")

B, T = 2, 12          # batch, sequence length for forward and training
P = 8                 # prompt length for generation (a sliding-window prefill must fit the window)
WINDOW = 8            # the shrunk sliding window: shorter than T, so it masks something
MAX_SEQ = 32          # KV-cache length
N_DECODE = 4          # single-token decode steps after the prefill

COMMON = dict(n_layer=2, n_embd=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=64)

# family -> (name of a real litgpt config, overrides that only shrink the model)
FAMILIES = {
    # Gemma 1: multi-query attention, scaled embeddings, GemmaMLP (tanh GELU), RMSNorm(1 + w).
    "gemma": ("Gemma-2b", dict(n_head=4, n_query_groups=1, head_size=16, intermediate_size=128)),
    # Gemma 2: GQA, attention and final-logit softcapping, post-attention/post-MLP norms,
    # attention_scores_scalar (256, not head_size), sliding window on every other layer.
    "gemma2": ("Gemma-2-2b", dict(n_head=4, n_query_groups=2, head_size=16, intermediate_size=128,
                                  sliding_window_size=WINDOW)),
    # Gemma 3: MQA, QK norm, local (sliding, RoPE base 1e4) and global (RoPE base 1e6) layers. The
    # real model has 5 local layers per global one, so its first two layers are both local; we keep
    # one of each, as the pattern has.
    "gemma3": ("Gemma-3-1b-it", dict(n_head=4, n_query_groups=1, head_size=16, intermediate_size=128,
                                     sliding_window_size=WINDOW, sliding_window_indices=[1, 0],
                                     rope_indices=[1, 0])),
    # Mistral 7B v0.1: GQA, LLaMAMLP, RMSNorm, sliding window on every layer.
    "mistral": ("Mistral-7B-v0.1", dict(n_head=4, n_query_groups=2, head_size=16, intermediate_size=128,
                                        sliding_window_size=WINDOW)),
    # Phi-2: parallel residual with one shared norm, LayerNorm, biases, lm_head bias, rotary on 40%
    # of each head, tanh GELU.
    "phi-2": ("phi-2", dict(n_head=4, head_size=16, intermediate_size=256)),
    # Qwen2.5: GQA, bias on the qkv projection only, rope_base 1e6, LLaMAMLP, RMSNorm eps 1e-6.
    "qwen2.5": ("Qwen2.5-0.5B", dict(n_head=4, n_query_groups=2, head_size=16, intermediate_size=128)),
}

# What each family must actually exercise, so a changed litgpt config cannot quietly test less.
FAMILY_FEATURES = {
    "gemma": dict(scale_embeddings=True, mlp_class_name="GemmaMLP", gelu_approximate="tanh",
                  norm_class_name="RMSNorm", n_query_groups=1, rotary_percentage=1.0, bias=False,
                  sliding_window_size=None, attention_logit_softcapping=None),
    "gemma2": dict(scale_embeddings=True, mlp_class_name="GemmaMLP", attention_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, post_attention_norm=True, post_mlp_norm=True,
                   attention_scores_scalar=256, sliding_window_size=WINDOW,
                   sliding_window_indices=[1, 0], n_query_groups=2),
    "gemma3": dict(scale_embeddings=True, mlp_class_name="GemmaMLP", norm_qk=True,
                   post_attention_norm=True, post_mlp_norm=True, rope_base=1000000,
                   rope_local_base_freq=10000, rope_indices=[1, 0], sliding_window_indices=[1, 0],
                   n_query_groups=1),
    "mistral": dict(mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", parallel_residual=False,
                    n_query_groups=2, bias=False, sliding_window_size=WINDOW,
                    sliding_window_indices=[1, 1]),
    "phi-2": dict(parallel_residual=True, shared_attention_norm=True, norm_class_name="LayerNorm",
                  mlp_class_name="GptNeoxMLP", bias=True, lm_head_bias=True, gelu_approximate="tanh",
                  rotary_percentage=0.4, rope_n_elem=6),
    "qwen2.5": dict(attn_bias=True, bias=False, rope_base=1000000, mlp_class_name="LLaMAMLP",
                    norm_class_name="RMSNorm", norm_eps=1e-6, n_query_groups=2),
}

SLIDING = ("gemma2", "gemma3", "mistral")



def make_config(family: str, **extra) -> Config:
    name, overrides = FAMILIES[family]
    return Config.from_name(name, **COMMON, **{**overrides, **extra})


def make_models(family: str, **extra):
    """A random-weight GPT for `family` and an identical deep copy to run eagerly."""
    return litgpt_models(make_config(family, **extra))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_mirrors_family(family):
    config = make_config(family)
    for attr, value in FAMILY_FEATURES[family].items():
        assert getattr(config, attr) == value, (family, attr)
    assert config.n_layer == 2 and config.padded_vocab_size == VOCAB and config.n_embd == 64
    assert config.n_head % config.n_query_groups == 0
    assert config.rope_n_elem % 2 == 0
    model = GPT(config)
    if config.bias or config.attn_bias:
        assert model.transformer.h[0].attn.qkv.bias is not None
    if family.startswith("gemma"):
        assert model.transformer.ln_f.add_unit_offset  # RMSNorm(1 + weight)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forward_matches_eager(family):
    model, ref = make_models(family)
    jmodel = keraunos.jit(model)

    x = tokens(B, T, seed=1)
    torch.testing.assert_close(jmodel(x), ref(x))
    assert keraunos.cache_misses(jmodel) == 1 and keraunos.cache_hits(jmodel) == 0
    # the logits came from a captured program, not from running the module eagerly
    assert "lm_head" in str(keraunos.last_traces(jmodel)[-1])

    # same shapes, other tokens: the cached program runs and still gives eager's logits
    x2 = tokens(B, T, seed=2)
    torch.testing.assert_close(jmodel(x2), ref(x2))
    assert keraunos.cache_misses(jmodel) == 1 and keraunos.cache_hits(jmodel) == 1


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_window_masks_something(family):
    """The shrunk window really changes the logits (so the forward test checks the window)."""
    model, _ = make_models(family)
    no_window, _ = make_models(family, sliding_window_size=None)
    x = tokens(B, T, seed=1)
    with torch.no_grad():
        assert not torch.allclose(model(x), no_window(x))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_backward_matches_eager(family):
    model, ref = make_models(family)
    targets = tokens(B, T, seed=5)

    def loss(logits):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    # logits, loss and every parameter's gradient
    jmodel = check_grads(model.train(), tokens(B, T, seed=4), ref=ref.train(), loss=loss,
                         require_all=True)
    assert keraunos.last_backward_traces(jmodel), "keraunos ran no backward trace of its own"

    # a second step on the cached program accumulates the same gradients as eager
    x2 = tokens(B, T, seed=6)
    loss(jmodel(x2)).backward()
    loss(ref(x2)).backward()
    assert keraunos.cache_hits(jmodel) == 1 and keraunos.cache_misses(jmodel) == 1
    assert_grads_match(model, ref, require_all=True)


def _generate_and_compare(model, ref, seed: int = 3, **options):
    """Prefill P prompt tokens, then N_DECODE single-token steps; compare logits at every step
    and every buffer (KV caches included) afterwards."""
    model.eval()
    ref.eval()
    jmodel = keraunos.jit(model, **options)
    with torch.no_grad():
        jmodel.set_kv_cache(batch_size=B, max_seq_length=MAX_SEQ)
        ref.set_kv_cache(batch_size=B, max_seq_length=MAX_SEQ)
        prompt = tokens(B, P, seed=seed)
        got = jmodel(prompt, input_pos=torch.arange(P))
        want = ref(prompt, input_pos=torch.arange(P))
        torch.testing.assert_close(got, want)
        assert got.shape == (B, P, VOCAB)
        for step in range(N_DECODE):
            pos = P + step
            tok = want[:, -1:].argmax(-1)  # greedy, from eager (equal to keraunos' just above)
            input_pos = torch.tensor([pos])
            got = jmodel(tok, input_pos=input_pos)
            want = ref(tok, input_pos=input_pos)
            torch.testing.assert_close(got, want,
                                       msg=lambda m, pos=pos: f"decode step at position {pos}: {m}")
    got_buffers = dict(model.named_buffers())
    want_buffers = dict(ref.named_buffers())
    assert got_buffers.keys() == want_buffers.keys()
    assert any(".kv_cache." in n for n in want_buffers), "no KV cache buffers to compare"
    for name, want_buffer in want_buffers.items():
        torch.testing.assert_close(got_buffers[name], want_buffer,
                                   msg=lambda m, name=name: f"buffer {name}: {m}")
    if not any(block.attn.apply_sliding_window_attention for block in model.transformer.h):
        # one entry for the prefill, one for decoding: decode steps differ only in tensor values.
        # (Not asserted for a sliding-window cache: how many entries its `.item()` should cost is
        # for whoever makes it capturable to decide.)
        assert keraunos.cache_misses(jmodel) == 2
        assert keraunos.cache_hits(jmodel) == N_DECODE - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_generation(family):
    """By default; the sliding-window families fall back to the backend route (their KV cache
    runs `input_pos.max().item()`), with one warning, and still match eager step by step."""
    model, ref = make_models(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _generate_and_compare(model, ref)
    fell_back = any("falls back to torch.compile" in str(w.message) for w in caught)
    assert fell_back == (family in SLIDING)


@pytest.mark.parametrize("family", SLIDING)
def test_kv_cache_generation_with_fallback_error_refuses_the_sliding_window(family):
    model, ref = make_models(family)
    with pytest.raises(CaptureError, match="item"):
        _generate_and_compare(model, ref, fallback="error")


@pytest.mark.parametrize("family", SLIDING)
def test_kv_cache_generation_with_sliding_window_specialized_on_data(family):
    """With specialize_data=True the ring buffer's `input_pos.max().item()` is computed by the
    prologue (a guarded constant, then a size symbol once it changes), and every step matches
    eager. (Compile counts: tests/test_symbolic.py's sliding-window generate test.)"""
    model, ref = make_models(family)
    _generate_and_compare(model, ref, specialize_data=True)


@pytest.mark.parametrize("family", SLIDING)
def test_kv_cache_generation_without_sliding_window(family):
    """The sliding-window families' decode path with the window off (a plain KV cache): softcapping,
    QK norm, local/global RoPE and the post norms all run in generation."""
    model, ref = make_models(family, sliding_window_size=None)
    _generate_and_compare(model, ref)
