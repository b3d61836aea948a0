"""Inspection: the prologue that runs says what it checks, traces carry the user's source lines,
and KERAUNOS_DEBUG logs compilations and writes every trace to a folder."""
from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

import keraunos
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
    assert "_attribute_guards" in final_text
    # Every attribute check the readable prologue writes (path == value) is named in a comment
    # of the batched check, or stays a Python line with its description (in the final prologue or
    # in the module-structure walk it calls).
    described = re.findall(r"# (module\.\S+ == .+)$", str(readable), flags=re.M)
    assert described
    batched = [d for d in described if f"#   {d}" in final_text]
    assert len(batched) >= 10
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
