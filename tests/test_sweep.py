"""The catalogue sweep (benchmarks/sweep.py, keraunos/testing/catalogue.py): a slice of it runs
here, each model type in a process of its own as the sweep runs it, and every value keraunos
computes is judged against a float64 run of the same model."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SWEEP = pathlib.Path(__file__).parent.parent / "benchmarks" / "sweep.py"

# One of each kind the catalogue builds: a decoder, an encoder with relative positions whose
# helpers are TorchScript functions, an encoder-decoder, a state-space model, a vision model, a
# mixture of experts with latent attention (its float64 reference loops over the experts).
SLICE = ["llama", "deberta-v2", "t5", "mamba", "vit", "deepseek_v3"]


# timm's families whose attention keeps its biases in a dict filled on the first eval call.
TIMM_SLICE = ["timm:levit_128s", "timm:tiny_vit_5m_224", "timm:efficientformerv2_s0"]


def _timm_available() -> bool:
    try:
        from keraunos.testing.vision import import_torchvision
        import_torchvision()
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def _sweep(tmp_path, names: list[str], system: str = "keraunos") -> dict:
    out = tmp_path / "sweep.jsonl"
    done = subprocess.run([sys.executable, str(SWEEP), "--only", ",".join(names),
                           "--systems", system, "--out", str(out), "--timeout", "400"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    return {r["model_type"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.long
@pytest.mark.skipif(not _timm_available(),
                    reason="timm is not installed (scripts/setup.sh puts it in .venv/vendor)")
def test_a_slice_of_timms_families_passes_against_float64(tmp_path):
    rows = _sweep(tmp_path, TIMM_SLICE)
    for name, row in rows.items():
        assert row.get("keraunos", {}).get("status") == "pass", row
        assert row["keraunos"]["route"] == "own capture", row


@pytest.mark.long
@pytest.mark.skipif(not _timm_available(),
                    reason="timm is not installed (scripts/setup.sh puts it in .venv/vendor)")
def test_a_deep_batchnorm_net_passes_against_float64_on_the_fused_program(tmp_path):
    """dpn68 with every call on the fused program: its last block's BatchNorm statistics,
    accumulated in float32, let one element through a ReLU that float64 stops, and its
    gradients were 8x eager's distance from float64."""
    row = _sweep(tmp_path, ["timm:dpn68"], "keraunos fused")["timm:dpn68"]
    assert row.get("keraunos fused", {}).get("status") == "pass", row
    assert row["keraunos fused"]["route"] == "own capture", row


def test_a_value_eager_float32_gets_wrong_by_more_than_its_size_is_counted_not_judged():
    import torch
    from keraunos.testing import catalogue
    reference = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    chaotic, fine = torch.tensor([3.0, 2.0, -2.0]), torch.tensor([1.001, -1.0, 0.5])

    def judged(got, eager):
        runs = [catalogue._Run([[t]], [{"w": t}]) for t in (got, eager, reference)]
        return catalogue.compare(*runs)
    ok, worst = judged(torch.tensor([9.0, 9.0, 9.0]), chaotic)
    assert ok and worst["not judged"] == 2  # the output and the gradient
    ok, worst = judged(torch.tensor([1.1, -1.0, 0.5]), fine)
    assert not ok and "not judged" not in worst


@pytest.mark.long
def test_a_slice_of_the_catalogue_passes_against_float64(tmp_path):
    rows = _sweep(tmp_path, SLICE)
    assert set(rows) == set(SLICE)
    for name, row in rows.items():
        assert "keraunos" in row, row  # built, and eager ran
        assert row["keraunos"]["status"] == "pass", row
        assert row["keraunos"]["route"] == "own capture", row


@pytest.mark.long
def test_a_slice_of_the_catalogue_passes_through_the_keraunos_backend(tmp_path):
    """``torch.compile(model, backend="keraunos")``: Dynamo's graphs, each compiled by keraunos.
    Not mamba: Dynamo itself stops at its cache's ``mark_static_address`` in the eval forward
    (an AssertionError before any backend is called; ``torch.compile(model)`` raises it too)."""
    names = [n for n in SLICE if n != "mamba"]
    rows = _sweep(tmp_path, names, "keraunos backend")
    assert set(rows) == set(names)
    for name, row in rows.items():
        assert row.get("keraunos backend", {}).get("status") == "pass", row
        assert row["keraunos backend"]["route"] == "every graph compiled", row


def test_the_table_counts_each_outcome_and_leaves_out_models_eager_could_not_run(tmp_path):
    sys.path.insert(0, str(SWEEP.parent))
    try:
        import sweep
    finally:
        sys.path.remove(str(SWEEP.parent))
    rows = [
        {"model_type": "a", "head": "AForCausalLM",
         "keraunos": {"status": "pass", "route": "own capture", "seconds": 1.0},
         "torch.compile": {"status": "pass", "seconds": 4.0}},
        {"model_type": "b", "head": "BModel",
         "keraunos": {"status": "wrong", "worst": {"value": "step 0 grad w", "ratio": 5.0},
                      "route": "own capture", "seconds": 2.0},
         "torch.compile": {"status": "internal error", "detail": "KeyError: x", "seconds": 1.0}},
        {"model_type": "c", "build": "ValueError: no"},
    ]
    fused = tmp_path / "fused.jsonl"  # a file of one system: its table has that system alone
    fused.write_text(json.dumps({"model_type": "d", "head": "D", "keraunos fused": {
        "status": "pass", "route": "own capture", "seconds": 3.0,
        "worst": {"value": "", "ratio": 0.5, "not judged": 4}}}) + "\n")
    text = sweep.table(fused)
    assert "| d | D | pass | own capture |\n" in text and "- keraunos fused: 1/1 pass" in text
    assert "not judged (eager float32's own error larger than the value): 4, in 1 models" in text
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = sweep.table(out, ["keraunos", "torch.compile"])
    assert "| a | AForCausalLM | pass | pass | own capture | 0.25 |" in text
    assert "wrong: step 0 grad w" in text and "internal error: KeyError: x" in text
    assert "- keraunos: 1/2 pass (pass 1, wrong 1)" in text
    assert "- torch.compile: 1/2 pass (internal error 1, pass 1)" in text
    assert "not counted: 1 model types" in text
    assert "keraunos, on its own capture: 2/2" in text


def test_shrinking_gives_each_stage_one_block_and_heads_that_divide_its_width():
    from transformers import SwinConfig
    from keraunos.testing import catalogue
    config = SwinConfig()  # heads (3, 6, 12, 24) over widths 96 to 768
    catalogue.shrink(config)
    stages = config.num_layers  # two of four: the per-stage lists keep the first two
    assert stages == 2 and list(config.depths) == [1] * stages and len(config.num_heads) == stages
    widths = [config.embed_dim * 2 ** i for i in range(stages)]
    assert config.embed_dim == 32
    assert all(width % heads == 0 for width, heads in zip(widths, config.num_heads))
