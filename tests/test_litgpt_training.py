"""Training litgpt's ``GPT`` through keraunos gives eager PyTorch's losses and gradients.

Four architectural families, each the real litgpt config of a released model shrunk to 2 layers and
a small width (n_embd 64, vocab 256, block_size 64); weights are random, nothing is downloaded.
In train mode we check, against an identical deep copy run eagerly:

* the loss and the gradient of every parameter, and that keraunos ran its own backward trace;
* 10 steps of ``torch.optim.AdamW`` (lr 1e-3) on the jitted model and on the eager copy: the loss of
  every step matches within float32 tolerance.

If keraunos cannot build a backward trace it warns and falls back to torch's autograd; that would
test nothing of keraunos' backward, so the warning is an error here.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import keraunos
from helpers import VOCAB, check_grads, litgpt_models

litgpt = pytest.importorskip("litgpt")
from litgpt import Config  # noqa: E402

# (the message regex cannot contain ":", the separator of warning filters, hence the ".")
pytestmark = pytest.mark.filterwarnings("error:keraunos. no backward trace")

B, T = 2, 16
STEPS = 10
COMMON = dict(n_layer=2, n_embd=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=64)

# family -> (real litgpt config name, overrides that only shrink the model)
FAMILIES = {
    "llama2": ("Llama-2-7b-hf", dict(n_head=4, n_query_groups=4, head_size=16,
                                     intermediate_size=176)),
    "falcon-7b": ("falcon-7b", dict(n_head=4, n_query_groups=1, head_size=16,
                                    intermediate_size=256)),
    "long-context-llama": ("LLaMA-2-7B-32K", dict(n_head=4, n_query_groups=4, head_size=16,
                                                  intermediate_size=176, rope_condense_ratio=4)),
    "mixtral": ("Mixtral-8x7B-v0.1", dict(n_head=4, n_query_groups=2, head_size=16,
                                          intermediate_size=96)),
}

# What each family must exercise, so that a changed litgpt config cannot quietly test less.
FEATURES = {
    "llama2": dict(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False),
    "falcon-7b": dict(norm_class_name="LayerNorm", parallel_residual=True,
                      shared_attention_norm=True, n_query_groups=1),
    "long-context-llama": dict(mlp_class_name="LLaMAMLP", rope_condense_ratio=4),
    "mixtral": dict(mlp_class_name="LLaMAMoE", n_expert=8, n_expert_per_token=2),
}


def make_models(family: str):
    name, overrides = FAMILIES[family]
    config = Config.from_name(name, **COMMON, **overrides)
    for attr, value in FEATURES[family].items():
        assert getattr(config, attr) == value, (family, attr)
    model, ref = litgpt_models(config)
    return model.train(), ref.train()


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)


def loss_of(logits, y):
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_loss_and_every_grad_match_eager(family):
    model, ref = make_models(family)
    x, y = batch(1)
    # the logits, the loss and every parameter's gradient
    jmodel = check_grads(model, x, ref=ref, loss=lambda logits: loss_of(logits, y), require_all=True)
    assert keraunos.last_backward_traces(jmodel), "keraunos built no backward trace"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adamw_steps_match_eager(family):
    model, ref = make_models(family)
    jmodel = keraunos.jit(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = batch(100 + step)
        for m, o, record in ((jmodel, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad(set_to_none=True)
            loss = loss_of(m(x), y)
            loss.backward()
            o.step()
            record.append(loss.item())
        assert_close(losses[-1], ref_losses[-1], rtol=1e-4, atol=1e-5,
                     msg=lambda m, step=step: f"loss at step {step}: {m}")
    # one compilation serves every step, and the loss actually moved
    assert keraunos.cache_misses(jmodel) == 1 and keraunos.cache_hits(jmodel) == STEPS - 1
    assert keraunos.last_backward_traces(jmodel)
    assert losses[-1] != losses[0]
    # after training the weights are still eager's
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5,
                     msg=lambda m, name=name: f"{name} after {STEPS} steps: {m}")
