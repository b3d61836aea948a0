"""The program store on real models: transformers' models are kept by a first process and loaded
by the next (their code reads registries of functions, decorators' closure cells and
module-level objects it checks by identity), and what their code depends on changing makes the
next process capture again. Every process compares its results with eager's."""
from __future__ import annotations

import textwrap

import pytest

from helpers import program_rows, run_with_store

pytest.importorskip("transformers")

RUN = textwrap.dedent('''
    import json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch, keraunos
    from keraunos.testing.zoo import inputs_of, make_models
    torch.set_num_threads(1)
    name = sys.argv[1]
    if os.environ.get("HALVE_SDPA"):  # another attention function registered under "sdpa"
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import AttentionInterface

        def halved(*args, **kwargs):
            out, weights = sdpa_attention_forward(*args, **kwargs)
            return out * 0.5, weights
        AttentionInterface.register("sdpa", halved)
    model, eager = make_models(name)
    jitted = keraunos.jit(model)
    results = []
    for seed in (0, 1):
        inputs = inputs_of(name, seed=seed, mask=False, labels=False)
        with torch.no_grad():
            got, want = jitted(**inputs), eager(**inputs)
        got = got.logits if hasattr(got, "logits") else got[0]
        want = want.logits if hasattr(want, "logits") else want[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        results.append(got.double().sum().item())
    keraunos.persist.programs.wait_for_keeps()
    stats = keraunos.compile_stats(jitted)
    print(json.dumps({"store": stats.program_store, "results": results,
                      "misses": keraunos.cache_misses(jitted)}))
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(RUN)
    return path


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_transformers_model_is_kept_and_a_restart_loads_it(script, tmp_path, name):
    """llama: ``ALL_ATTENTION_FUNCTIONS``, ``create_causal_mask`` under ``deprecate_kwarg`` (its
    cells), ``forward`` under decorators; t5: ``ACT2FN`` and an encoder-decoder."""
    store = tmp_path / "store"
    first = run_with_store(script, [name], store)
    assert first["store"] == "kept", first
    assert len(program_rows(store)) == 1
    second = run_with_store(script, [name], store)
    assert second["store"] == "loaded", second
    assert second["results"] == first["results"] and second["misses"] == first["misses"]


def test_another_function_in_the_attention_registry_is_captured_not_loaded(script, tmp_path):
    """The registry's contents are in the key: a process whose "sdpa" entry is another function
    (its outputs halved, as eager's are) captures, and matches eager."""
    store = tmp_path / "store"
    first = run_with_store(script, ["llama"], store)
    assert first["store"] == "kept", first
    other = run_with_store(script, ["llama"], store, env={"HALVE_SDPA": "1"})
    assert other["store"] == "kept", other  # captured, and kept under a key of its own
    assert other["results"] != first["results"]
    assert len(program_rows(store)) == 2
