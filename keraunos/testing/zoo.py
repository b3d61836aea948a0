"""The model zoo: current Hugging Face ``transformers`` architectures from tiny configs.

Each model is built from a tiny config (hidden 32, 2 layers, vocab 128, sequence 8) with random
weights; nothing is downloaded (``HF_HUB_OFFLINE=1`` is set before transformers is imported).
The zoo spans decoder-only models with different attention, normalization and rotary variants,
mixture-of-experts, encoder-only, encoder-decoder and vision models. ``tests/test_model_zoo.py``
runs it under ``keraunos.jit`` and the ``torch.compile`` backend, ``benchmarks/models.py`` times
it; the comparison helpers (``assert_same_output``, ``assert_same_grads``,
``assert_training_step_matches``) serve ``tests/test_transformers.py`` and any other test that
compares a model with its eager copy.

    >>> from keraunos.testing import zoo
    >>> model, ref = zoo.make_models("llama")           # doctest: +SKIP
    >>> out = model(**zoo.inputs_of("llama", seed=1, mask=True, labels=False))  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no network


class _Transformers:
    """``transformers``, imported on first use (keraunos itself does not need it)."""

    def __getattr__(self, name):
        import transformers
        return getattr(transformers, name)


tf = _Transformers()

VOCAB, B, T = 128, 2, 8
IMAGE, PATCH, CHANNELS = 16, 8, 3

# the common tiny sizes, in the spellings most configs use
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64)
TINY_GQA = dict(TINY, num_key_value_heads=2)

# What blocks keraunos today, as the error says it.
MOE_BACKWARD = (
    "keraunos builds no backward trace: transformers' MoE experts run the custom op "
    "transformers::grouped_mm_fallback, whose registered backward loops over `offs.tolist()`: "
    "GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0, 0) "
    "(transformers/integrations/moe.py:229 in _grouped_mm_fallback_backward). keraunos warns and "
    "PyTorch's autograd gives eager's gradients (test_moe_training_falls_back_to_torch_autograd)")


def moe_backward_is_an_op() -> bool:
    """Whether transformers registers its MoE experts' backward as a custom op of its own
    (``transformers::grouped_mm_fallback_backward``, from 5.2x): capture records it as one op,
    so the backward trace is built. Earlier releases loop over ``offs.tolist()`` in the backward
    (MOE_BACKWARD)."""
    try:
        import transformers.integrations.moe  # noqa: F401 - registers the ops
    except ImportError:
        return False
    return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")


# The zoo's BART drops layers in train mode (transformers skips the draw when layerdrop is 0).
BART_LAYERDROP = (
    "DataDependentError: keraunos cannot capture transformers/models/bart/modeling_bart.py: "
    "`if dropout_probability < self.layerdrop:` in train mode (a Python decision on "
    "torch.rand([])); keraunos.jit(model, fallback=\"dynamo\") is the route for it")


@dataclass
class Arch:
    """One zoo entry: how to build it and what its inputs are."""
    build: Callable[[], torch.nn.Module]
    inputs: str            # "causal" (a decoder), "text", "seq2seq", "image" or "text+image"
    takes_mask: bool = True
    trains: bool = True               # has a loss head (labels=, or return_loss= for CLIP)
    xfail_forward: str | None = None
    xfail_train: str | None = None
    label_kind: str = "tokens"        # "tokens" (B, T), "class" (B,)
    extra: dict = field(default_factory=dict)


def build(config_cls, model_cls, **kw):
    return lambda: getattr(tf, model_cls)(getattr(tf, config_cls)(**kw))


_MOE_TRAIN = None if moe_backward_is_an_op() else MOE_BACKWARD
ZOO: dict[str, Arch] = {
    # decoder-only: RMSNorm + rotary + grouped-query attention, and variations on it
    "llama": Arch(build("LlamaConfig", "LlamaForCausalLM", **TINY_GQA), "causal"),
    "mistral": Arch(build("MistralConfig", "MistralForCausalLM", **TINY_GQA, sliding_window=4),
                    "causal"),
    "qwen2": Arch(build("Qwen2Config", "Qwen2ForCausalLM", **TINY_GQA), "causal"),   # qkv bias
    "qwen3": Arch(build("Qwen3Config", "Qwen3ForCausalLM", **TINY_GQA, head_dim=8),
                  "causal"),                                                           # q/k norm
    "gemma": Arch(build("GemmaConfig", "GemmaForCausalLM", **TINY_GQA, head_dim=8),
                  "causal"),                                   # (1 + w) RMSNorm, scaled embedding
    "gemma2": Arch(build("Gemma2Config", "Gemma2ForCausalLM", **TINY_GQA, head_dim=8,
                          sliding_window=4), "causal"),  # soft-capping, alternating sliding window
    "phi3": Arch(build("Phi3Config", "Phi3ForCausalLM", **TINY_GQA, pad_token_id=0),
                 "causal"),                                            # fused qkv and gate_up
    "olmo": Arch(build("OlmoConfig", "OlmoForCausalLM", **TINY_GQA, pad_token_id=0),
                 "causal"),                                           # non-parametric LayerNorm
    "gpt2": Arch(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)), "causal"),
    "gpt_neox": Arch(build("GPTNeoXConfig", "GPTNeoXForCausalLM", **TINY, rotary_pct=0.5),
                     "causal"),                             # parallel residual, partial rotary
    "falcon": Arch(lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=True, num_kv_heads=2)), "causal"),
    # mixture-of-experts
    "mixtral": Arch(build("MixtralConfig", "MixtralForCausalLM", **TINY_GQA, num_local_experts=4,
                           num_experts_per_tok=2), "causal", xfail_train=_MOE_TRAIN),
    "qwen2_moe": Arch(build("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **TINY_GQA, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32), "causal",
                      xfail_train=_MOE_TRAIN),
    # encoder-only
    "bert": Arch(build("BertConfig", "BertForMaskedLM", **TINY), "text"),
    "roberta": Arch(build("RobertaConfig", "RobertaForMaskedLM", **TINY, pad_token_id=1),
                    "text"),
    # relative-position attention whose helpers are ``torch.jit.script`` functions
    "deberta_v2": Arch(build("DebertaV2Config", "DebertaV2ForMaskedLM", **TINY,
                             relative_attention=True, position_buckets=8,
                             pos_att_type=["p2c", "c2p"]), "text"),
    "distilbert": Arch(lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(
        vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
        max_position_embeddings=64)), "text"),
    # encoder-decoder
    "t5": Arch(lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0)), "seq2seq"),
    "bart": Arch(lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, encoder_layerdrop=0.1,
        decoder_layerdrop=0.1)), "seq2seq", xfail_train=BART_LAYERDROP),
    # vision
    "vit": Arch(lambda: tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=IMAGE, patch_size=PATCH, num_labels=3)), "image", takes_mask=False,
        label_kind="class"),
    "resnet": Arch(lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)), "image",
        takes_mask=False, label_kind="class"),
    "clip": Arch(lambda: tf.CLIPModel(tf.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=IMAGE, patch_size=PATCH),
        projection_dim=16)), "text+image"),
}


def perturb_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights start at exactly 1 and biases at 0, which would hide a dropped scale or
    shift: give every 1-D parameter random values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.1)
    return model


def eval_and_copy(model: torch.nn.Module):
    """``model`` in eval mode and an identical deep copy of it to run eagerly."""
    perturb_norms(model).eval()
    return model, copy.deepcopy(model)


def make_models(name: str):
    """A random-weight zoo model and an identical deep copy to run eagerly, in eval mode."""
    torch.manual_seed(0)
    return eval_and_copy(ZOO[name].build())


def tokens(*shape, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, shape, generator=g)  # 2..: no pad token (0 or 1)


def padding_mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -3:] = 0  # right padding: every model family accepts it
    return mask


def inputs_of(name: str, *, seed: int, mask: bool, labels: bool) -> dict:
    arch = ZOO[name]
    g = torch.Generator().manual_seed(seed)
    kwargs = {}
    if arch.inputs in ("causal", "text", "seq2seq", "text+image"):
        kwargs["input_ids"] = tokens(B, T, seed=seed)
    if "image" in arch.inputs:
        kwargs["pixel_values"] = torch.randn(B, CHANNELS, IMAGE, IMAGE, generator=g)
    if arch.inputs == "seq2seq" and not labels:
        kwargs["decoder_input_ids"] = tokens(B, T, seed=seed + 100)
    if mask and arch.takes_mask:
        kwargs["attention_mask"] = padding_mask()
    if labels:
        if arch.inputs == "text+image":
            kwargs["return_loss"] = True
        elif arch.label_kind == "class":
            kwargs["labels"] = torch.randint(0, 3, (B,), generator=g)
        else:
            kwargs["labels"] = tokens(B, T, seed=seed + 200)
    if arch.inputs in ("causal", "seq2seq"):
        kwargs["use_cache"] = False  # the DynamicCache route is tests/test_transformers.py's
    return kwargs | arch.extra


def assert_same_output(got, want, path="output", tolerance: dict | None = None):
    """Every field of a ModelOutput (or nested tuple/list/DynamicCache) equals eager's: type,
    keys, ``requires_grad`` and values (``tolerance``: ``assert_close``'s rtol/atol)."""
    tol = tolerance or {}
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{path} is a {type(got).__name__}, not a plain tensor"
        assert got.requires_grad == want.requires_grad, path
        torch.testing.assert_close(got, want, msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(want, tf.utils.ModelOutput):
        assert type(got) is type(want), path
        assert list(got.keys()) == list(want.keys()), path
        for key in want.keys():
            assert_same_output(got[key], want[key], f"{path}.{key}", tolerance)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_output(g, w, f"{path}[{i}]", tolerance)
    elif isinstance(want, tf.DynamicCache):
        assert type(got) is type(want), path
        assert got is not want
        assert len(got.layers) == len(want.layers), path
        for i, (g, w) in enumerate(zip(got.layers, want.layers)):
            assert_same_output(g.keys, w.keys, f"{path}.layers[{i}].keys", tolerance)
            assert_same_output(g.values, w.values, f"{path}.layers[{i}].values", tolerance)
        assert got.get_seq_length() == want.get_seq_length()
    else:
        assert got == want, path


def assert_same_grads(model, ref, tolerance: dict | None = None):
    """Every parameter's gradient equals eager's, or is ``None`` where eager's is; at least one
    gradient exists."""
    ref_params = dict(ref.named_parameters())
    n_grads = 0
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if want is None:
            assert p.grad is None, f"eager has no grad for {name}, keraunos has one"
            continue
        assert p.grad is not None, f"no grad for {name}"
        torch.testing.assert_close(p.grad, want, msg=lambda m, name=name: f"grad of {name}: {m}",
                                   **(tolerance or {}))
        n_grads += 1
    assert n_grads > 0


def assert_training_step_matches(runner, model, ref, kwargs: dict, *, seed: int = 10,
                                 tolerance: dict | None = None):
    """One train-mode call of ``runner`` (``model`` jitted or compiled) and of ``ref`` under the
    same ``torch.manual_seed`` (the same dropout masks): the outputs, then after
    ``loss.backward()`` every gradient, equal eager's. Returns the runner's output."""
    model.train()
    ref.train()
    torch.manual_seed(seed)
    out = runner(**kwargs)
    torch.manual_seed(seed)
    ref_out = ref(**kwargs)
    assert_same_output(out, ref_out, tolerance=tolerance)
    out.loss.backward()
    ref_out.loss.backward()
    assert_same_grads(model, ref, tolerance)
    return out
