"""A zoo of current Hugging Face ``transformers`` architectures under ``keraunos.jit`` and
``torch.compile(backend="keraunos")``.

The zoo itself (``keraunos.testing.zoo``): each model is built from a tiny config (hidden 32,
2 layers, vocab 128, sequence 8) with random weights; nothing is downloaded
(``HF_HUB_OFFLINE=1``). It spans decoder-only models with different attention, normalization and
rotary variants, mixture-of-experts, encoder-only, encoder-decoder and vision models. For every
model, against an identical deep copy run eagerly:

* ``test_forward``: eval mode, with a padding mask where the model takes one (a second call with
  other inputs of the same shapes must be a cache hit and still give eager's outputs);
* ``test_training_step`` (every model with a loss head): train mode with the config's dropout,
  labels, no attention mask, under one ``torch.manual_seed``: the loss, every output and every
  parameter's gradient (or its absence) must equal eager's;
* ``test_forward_and_training_under_the_backend``: both of the above through
  ``torch.compile(backend="keraunos")`` (one compiled module, dynamo recompiles for train mode).

A model keraunos cannot run yet is marked ``xfail(strict=True)`` with the exact blocking error;
what it does instead is tested too: MoE training falls back to PyTorch's autograd with a warning,
and BART's train-mode layerdrop (a Python decision on tensor data) is a graph break under
``torch.compile(backend="keraunos")``, through which BART trains like eager.
"""
from __future__ import annotations

import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch the network

import pytest  # noqa: E402
import torch  # noqa: E402

import keraunos  # noqa: E402
from keraunos.testing.zoo import (MOE_BACKWARD, ZOO,  # noqa: E402
                                  assert_same_output, assert_training_step_matches,
                                  inputs_of, make_models)

pytest.importorskip("transformers")

# a fallback to torch's autograd would test nothing of keraunos' backward
pytestmark = pytest.mark.filterwarnings("error:keraunos. no backward trace")

FUSED_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # Inductor reorders reductions


def cases(test: str):
    params = []
    for name, arch in ZOO.items():
        if test == "train" and not arch.trains:
            continue
        reason = arch.xfail_forward if test == "forward" else arch.xfail_train
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.mark.parametrize("name", cases("forward"))
def test_forward(name):
    model, ref = make_models(name)
    jmodel = keraunos.jit(model)
    with torch.no_grad():
        for seed in (1, 2):
            kwargs = inputs_of(name, seed=seed, mask=True, labels=False)
            assert_same_output(jmodel(**kwargs), ref(**kwargs))
    assert keraunos.cache_misses(jmodel) == 1 and keraunos.cache_hits(jmodel) == 1
    # the result came from a captured program, not from running the module eagerly
    assert "linear" in str(keraunos.last_traces(jmodel)[-1]) or name == "resnet"


@pytest.mark.parametrize("name", cases("train"))
def test_training_step(name):
    model, ref = make_models(name)
    jmodel = keraunos.jit(model)
    kwargs = inputs_of(name, seed=3, mask=False, labels=True)
    assert_training_step_matches(jmodel, model, ref, kwargs)
    assert keraunos.last_backward_traces(jmodel), "keraunos ran no backward trace of its own"


@pytest.mark.filterwarnings("ignore:keraunos. no backward trace")
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_training_falls_back_to_torch_autograd(name):
    """Until keraunos can trace the MoE experts' backward (see MOE_BACKWARD), it says so and
    PyTorch's autograd over the jitted forward gives eager's loss and gradients."""
    model, ref = make_models(name)
    jmodel = keraunos.jit(model)
    kwargs = inputs_of(name, seed=3, mask=False, labels=True)
    if ZOO[name].xfail_train != MOE_BACKWARD:  # transformers registers the backward as an op
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*no backward trace")
            assert_training_step_matches(jmodel, model, ref, kwargs)
        assert keraunos.last_backward_traces(jmodel)
        return
    with pytest.warns(UserWarning, match="no backward trace"):
        assert_training_step_matches(jmodel, model, ref, kwargs)


def test_llama_training_step_under_the_backend_with_fusion():
    """torch.compile(backend=keraunos.dynamo.backend(executors=["inductor", "torch"])): the
    forward and backward traces get Inductor regions, not cut at the two decoder layers (fewer
    than BACKEND_MIN_SHARED_LAYERS: Dynamo's graph is fused whole, as Inductor does), and the
    loss, outputs and every gradient are eager's (within Inductor's reordering of reductions).
    (gpt2, with its graph break in the loss, and bert pass too; each costs minutes of compiles.)"""
    import keraunos.dynamo
    torch._dynamo.reset()
    model, ref = make_models("llama")
    be = keraunos.dynamo.backend(executors=["inductor", "torch"], fuse="wait")
    compiled = torch.compile(model, backend=be)
    kwargs = inputs_of("llama", seed=3, mask=False, labels=True)
    assert_training_step_matches(compiled, model, ref, kwargs, tolerance=FUSED_TOLERANCE)
    (subgraph,) = be.subgraphs
    fusions = keraunos.last_fusions(subgraph.jitted)
    for trace_name in ("computation", "backward"):
        regions = [r for r in fusions if r.trace_name == trace_name]
        assert regions and all(r.layer is None for r in regions), trace_name


@pytest.mark.filterwarnings("ignore:keraunos. no backward trace")  # MoE: asserted below
@pytest.mark.parametrize("name", list(ZOO))
def test_forward_and_training_under_the_backend(name):
    """Every zoo model under torch.compile(backend="keraunos"): eval forward with the padding
    mask (twice: the second call runs the compiled subgraphs), then, for a model with a loss
    head, a train-mode step; each subgraph went through keraunos."""
    import keraunos.dynamo
    torch._dynamo.reset()
    model, ref = make_models(name)
    compiled = torch.compile(model, backend="keraunos")
    with torch.no_grad():
        for seed in (1, 2):
            kwargs = inputs_of(name, seed=seed, mask=True, labels=False)
            assert_same_output(compiled(**kwargs), ref(**kwargs))
    assert keraunos.dynamo.last_traces(compiled), "no subgraph went through keraunos"
    if not ZOO[name].trains:
        return
    kwargs = inputs_of(name, seed=3, mask=False, labels=True)
    if ZOO[name].xfail_train == MOE_BACKWARD:  # as under keraunos.jit: PyTorch's autograd
        with pytest.warns(UserWarning, match="no backward trace"):
            assert_training_step_matches(compiled, model, ref, kwargs)
        return
    assert_training_step_matches(compiled, model, ref, kwargs)
    assert any(t.backward for t in keraunos.dynamo.last_traces(compiled))
    if name == "bart":  # its train-mode layerdrop, which keraunos.jit refuses (BART_LAYERDROP)
        breaks = keraunos.dynamo.graph_breaks(compiled)
        assert any("modeling_bart.py" in b.filename for b in breaks), breaks
