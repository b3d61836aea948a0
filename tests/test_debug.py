"""Inspection: the prologue that runs says what it checks, traces carry the user's source lines,
and KERAUNOS_DEBUG logs compilations and writes every trace to a folder."""
from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

import keraunos
from keraunos import debug
from keraunos.runtime.call import state_of
from keraunos.examples.gpt import GPT, GPTConfig


def _small_gpt(n_layer=1):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=4)).eval()


def _jitted_gpt(grad=False):
    model = _small_gpt()
    reference = copy.deepcopy(model)
    jmodel = keraunos.jit(model)
    idx = torch.randint(0, 256, (2, 8))
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(jmodel(idx), reference(idx))
    return jmodel


# ------------------------------------------------------------------- readable final prologue
def test_final_prologue_lists_every_tensor_it_checks():
    jmodel = _jitted_gpt()
    final = str(keraunos.last_prologue_traces(jmodel)[-1])
    assert "_tensor_guards" in final  # the batched check is what runs
    for p in keraunos.last_traces(jmodel)[0].params:
        real_line = [line for line in final.splitlines()
                     if re.match(rf"\s*#\s+{p.name} from {re.escape(p.provenance)}:", line)]
        assert len(real_line) == 1, p.name
        line = real_line[0]
        assert f"shape {tuple(p.shape)}," in line
        assert "stride (" in line and f"dtype {p.dtype}" in line
        assert f"device {p.device}" in line and f"requires_grad {p.requires_grad}" in line


def test_final_prologue_lists_module_attributes_in_the_words_of_the_unbatched_one():
    jmodel = _jitted_gpt()
    readable, walk, final = keraunos.last_prologue_traces(jmodel)
    final_text = str(final)
    assert "_attribute_dicts[" in final_text  # read from the cached dicts, by identity
    # Every attribute check the readable prologue writes (path == value) stays a Python line with
    # its description (in the final prologue or in the module-structure walk it calls).
    described = re.findall(r"# (module\.\S+ == .+)$", str(readable), flags=re.M)
    assert len(described) >= 10
    for description in described:
        assert re.search(rf"#\s+{re.escape(description)}$", final_text + str(walk), flags=re.M), \
            description


def test_prologue_comments_add_nothing_to_the_code_that_runs():
    jmodel = _jitted_gpt()
    source = str(keraunos.last_prologue_traces(jmodel)[-1])
    stripped = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    with_comments = compile(source, "<with>", "exec").co_consts
    without = compile(stripped, "<without>", "exec").co_consts
    code_of = lambda consts: [c.co_code for c in consts if hasattr(c, "co_code")]  # noqa: E731
    assert code_of(with_comments) == code_of(without)


# ---------------------------------------------------------------------------- source lines
def _gpt_source_lines(trace) -> list[str]:
    return re.findall(r"# \S*keraunos/examples/gpt\.py:\d+: (.*)$", str(trace), flags=re.M)


def test_shipped_example_ops_carry_its_source_lines():
    jmodel = _jitted_gpt()
    lines = _gpt_source_lines(keraunos.last_traces(jmodel)[-1])
    assert "q, k, v = self.qkv(x).split(C, dim=2)" in lines
    assert "x = x + self.attn(self.ln_1(x))" in lines
    text = str(keraunos.last_traces(jmodel)[-1])
    # The comment sits right above the first op it produced.
    lines_of_text = text.splitlines()
    at = next(i for i, line in enumerate(lines_of_text) if line.endswith("self.qkv(x).split(C, dim=2)"))
    assert "torch.nn.functional.linear(" in lines_of_text[at + 1]
    assert "qkv_weight" in lines_of_text[at + 1]


def test_training_trace_attributes_ops_to_many_model_lines():
    jmodel = _jitted_gpt(grad=True)
    lines = set(_gpt_source_lines(keraunos.last_traces(jmodel)[-1]))
    assert len(lines) >= 8, lines


def test_keraunos_machinery_is_not_user_code():
    from keraunos import errors
    assert errors.is_internal(keraunos.jit.__code__.co_filename)
    assert errors.is_internal(torch.nn.functional.linear.__module__ and torch.__file__)
    assert not errors.is_internal(GPT.forward.__code__.co_filename)
    assert not errors.is_internal(__file__)


# ------------------------------------------------------------------------- KERAUNOS_DEBUG
def _sin_plus_one(x):
    return x.sin() + 1


def _run_twice_with_new_shape():
    jf = keraunos.jit(_sin_plus_one)
    for n in (3, 4):
        x = torch.randn(n)
        torch.testing.assert_close(jf(x), _sin_plus_one(x))
    return jf


def test_debug_level_comes_from_the_environment(monkeypatch):
    for raw, expected in (("", 0), ("0", 0), ("1", 1), ("2", 2), ("3", 3), ("9", 3), ("yes", 1)):
        monkeypatch.setenv("KERAUNOS_DEBUG", raw)
        assert debug.level() == expected, raw
    monkeypatch.delenv("KERAUNOS_DEBUG")
    assert debug.level() is debug.DebugLevel.OFF


def test_debug_1_logs_each_compilation_with_why_and_stage_times(monkeypatch, caplog):
    monkeypatch.setenv("KERAUNOS_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger="keraunos"):
        jf = _run_twice_with_new_shape()
    messages = [r.getMessage() for r in caplog.records if r.name == "keraunos"]
    assert len(messages) == 2  # two compilations, nothing logged for hits
    first, second = messages
    assert "compiled _sin_plus_one (compilation 1)" in first and 'x: "cpu f32[3]"' in first
    assert "first call" in first
    assert "compilation 2" in second and "size mismatch" in second
    for stage in keraunos.compile_stats(jf).stages:
        assert stage in second
    assert re.search(r"capture\s+\d+\.\d+ ms", second)
    with caplog.at_level(logging.INFO, logger="keraunos"):
        jf(torch.randn(4))
    assert len([r for r in caplog.records if r.name == "keraunos"]) == 2  # a hit logs nothing


def test_debug_off_logs_nothing(monkeypatch, caplog):
    monkeypatch.delenv("KERAUNOS_DEBUG", raising=False)
    with caplog.at_level(logging.DEBUG, logger="keraunos"):
        _run_twice_with_new_shape()
    assert not [r for r in caplog.records if r.name == "keraunos"]


def test_debug_2_writes_every_trace_after_every_pass(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("KERAUNOS_DEBUG", "2")
    monkeypatch.setenv("KERAUNOS_DEBUG_DIR", str(tmp_path))
    monkeypatch.setattr(debug, "_folder", [])
    with caplog.at_level(logging.INFO, logger="keraunos"):
        jf = _run_twice_with_new_shape()
    assert any(str(tmp_path) in r.getMessage() and "writes every trace" in r.getMessage()
               for r in caplog.records)
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 2
    written = sorted(p.name for p in folders[-1].glob("*.py"))
    histories = debug.trace_histories(state_of(jf).last_entry)
    assert len(written) == sum(len(traces) for traces in histories.values())
    # Each file is the trace's text, and runs as Python.
    last = keraunos.last_traces(jf)[-1]
    (name,) = [n for n in written if n.startswith(f"computation_{len(histories['computation']) - 1:02d}")]
    assert (folders[-1] / name).read_text() == str(last)
    compile((folders[-1] / name).read_text(), name, "exec")
    assert "size mismatch" in (folders[-1] / "compilation.txt").read_text()


def test_debug_3_writes_fusion_kernels_when_an_entry_has_them(tmp_path):
    # No fusion executor exists yet: the code path is exercised with an entry that carries regions.
    class Region:
        name, source = "fusion0 (add, mul)", "def fusion0(a, b):\n  return (a + b) * b\n"

    class Entry:
        fusion_regions = [Region()]
    debug.write_fusion_kernels(str(tmp_path), Entry())
    (kernel,) = (tmp_path / "fusion").iterdir()
    assert kernel.read_text() == Region.source
    debug.write_fusion_kernels(str(tmp_path / "none"), object())
    assert not (tmp_path / "none").exists()


def test_compilations_are_remembered_with_their_miss_reasons():
    jf = _run_twice_with_new_shape()
    records = debug.compilations(state_of(jf))
    assert [r.number for r in records] == [1, 2]
    assert records[0].miss_reasons == []
    assert "size mismatch" in records[1].miss_reasons[0]
    assert records[1].entry is state_of(jf).last_entry
