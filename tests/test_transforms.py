"""Transforms: each hook runs at its point, the documented examples run, the prologue transforms
remove exactly the checks they claim, tags survive passes."""
import pathlib
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import keraunos
from keraunos.runtime.jitted import JittedModule
from keraunos.core.tags import INPUT_TENSOR, MODULE_CHECK, STATIC_MEMORY_LOCATION
from keraunos.transforms import ExtractionOnlyPrologueTransform, PrunePrologueChecks

DOC = pathlib.Path(__file__).parent.parent / "docs" / "transforms.md"


def _doc_example(title: str) -> str:
    text = DOC.read_text()
    section = text.split(f"## {title}", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_doc_example_replacing_gelu_runs_and_changes_the_trace(capsys):
    namespace = {}
    exec(_doc_example("Example 1"), namespace)
    assert "approximate='tanh'" in capsys.readouterr().out
    f, x = namespace["f"], namespace["x"]
    assert any(h.startswith("Constructed by TanhGelu") for h in keraunos.last_traces(f)[-1].header)


def test_doc_example_profiler_ranges_name_every_op(capsys):
    namespace = {}
    exec(_doc_example("Example 2"), namespace)
    assert "['matmul', 'relu', 'sum']" in capsys.readouterr().out
    f, x, y = namespace["f"], namespace["x"], namespace["y"]
    torch.testing.assert_close(f(x, y), (x @ y).relu().sum())


class Recorder(keraunos.Transform):
    def __init__(self):
        self.calls = []

    def transform_module(self, jitted_module):
        # The jitted module presents the original's class name (Trainer and Lightning read it).
        self.calls.append(("module", type(jitted_module).__name__,
                           isinstance(jitted_module, JittedModule)))

    def transform_traces_pre_prologue(self, prologue, computation, epilogue):
        self.calls.append(("pre_prologue", prologue.name, computation.name, epilogue.name,
                           computation.header[-1]))
        return prologue, computation, epilogue

    def transform_trace_post_optimization(self, trace):
        self.calls.append(("post_optimization", trace.header[-1], trace.name))
        return trace


def test_each_hook_runs_once_per_compile_at_its_point():
    rec = Recorder()
    jm = keraunos.jit(nn.Linear(4, 4), transforms=[rec])
    assert rec.calls == [("module", "Linear", True)]
    x = torch.randn(2, 4)
    jm(x)
    jm(x)  # a cache hit runs no hook
    assert rec.calls[1] == ("pre_prologue", "prologue", "computation", "epilogue",
                            "Constructed by capture")
    # after the executors claimed the ops: for the forward, then for the backward
    assert [c[0] for c in rec.calls[2:]] == ["post_optimization", "post_optimization"]
    assert all(c[1].startswith("Constructed by Executor Claims") for c in rec.calls[2:])
    assert [c[2] for c in rec.calls[2:]] == ["computation", "backward"]
    jm(torch.randn(3, 4))  # a miss runs them again
    assert [c[0] for c in rec.calls[4:]] == ["pre_prologue", "post_optimization",
                                             "post_optimization"]
    with torch.no_grad():  # no backward: the hook runs for the forward only
        jm(torch.randn(5, 4))
    assert [c[0] for c in rec.calls[7:]] == ["pre_prologue", "post_optimization"]


def test_transform_output_is_labelled_in_the_trace_lists():
    jf = keraunos.jit(lambda x: x.sin(), transforms=[Recorder()])
    jf(torch.randn(3))
    assert any(h.startswith("Constructed by Recorder") for h in keraunos.last_traces(jf)[-1].header)
    assert any(h.startswith("Constructed by Recorder")
               for t in keraunos.last_prologue_traces(jf) for h in t.header)
    assert "transform Recorder" in keraunos.compile_stats(jf).stages


def test_transform_must_be_a_transform_instance():
    with pytest.raises(TypeError, match="Transform"):
        keraunos.jit(lambda x: x, transforms=[object()])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc(x))


def _checked_tensors(jm):
    readable = next(t for t in keraunos.last_prologue_traces(jm)
                    if t.header[-1].startswith("Constructed by") and t.name == "prologue"
                    and not t.header[-1].startswith("Constructed by Fast"))
    transformed = [t for t in keraunos.last_prologue_traces(jm) if t.name == "prologue"
                   and not t.header[-1].startswith("Constructed by Fast")][-1]
    return readable, transformed


def _checks(trace):
    return [b for b in trace.bound_symbols if b.symbol.name in ("check", "check_tensor")]


def test_extraction_only_removes_exactly_the_static_tensor_checks():
    model = Block()
    jm = keraunos.jit(model, transforms=[ExtractionOnlyPrologueTransform()])
    x = torch.randn(2, 4)
    torch.testing.assert_close(jm(x), model(x))
    captured, transformed = keraunos.last_prologue_traces(jm)[0], keraunos.last_prologue_traces(jm)[1]
    removed = [b for b in _checks(captured) if b not in _checks(transformed)]
    assert removed and all(b.symbol.name == "check_tensor" and
                           STATIC_MEMORY_LOCATION in b.args[0].tags for b in removed)
    kept_tensors = [b.args[0].name for b in _checks(transformed) if b.symbol.name == "check_tensor"]
    assert kept_tensors == ["x"]
    # extraction stays: a replaced parameter is used
    model.fc.weight = nn.Parameter(torch.randn(4, 4))
    torch.testing.assert_close(jm(x), model(x))
    # argument checks stay: a new shape recompiles
    misses = keraunos.cache_misses(jm)
    x5 = torch.randn(5, 4)
    torch.testing.assert_close(jm(x5), model(x5))
    assert keraunos.cache_misses(jm) == misses + 1


def test_extraction_only_can_skip_argument_checks_too():
    jm = keraunos.jit(Block(), transforms=[ExtractionOnlyPrologueTransform(
        skip_check_on_input_tensors=True)])
    jm(torch.randn(2, 4))
    transformed = keraunos.last_prologue_traces(jm)[1]
    assert not [b for b in _checks(transformed) if b.symbol.name == "check_tensor"]
    assert not any(INPUT_TENSOR in b.args[0].tags or STATIC_MEMORY_LOCATION in b.args[0].tags
                   for b in transformed.bound_symbols if b.symbol.name == "check_tensor")


def test_extraction_only_still_sees_a_changed_module_attribute():
    model = Block()
    jm = keraunos.jit(model, transforms=[ExtractionOnlyPrologueTransform()])
    x = torch.randn(2, 4)
    jm(x)
    model.norm.eps = 0.5
    torch.testing.assert_close(jm(x), model(x))
    assert keraunos.cache_misses(jm) == 2


def test_prune_prologue_checks_keeps_only_argument_and_global_checks():
    model = Block()
    jm = keraunos.jit(model, transforms=[PrunePrologueChecks()])
    x = torch.randn(2, 4)
    torch.testing.assert_close(jm(x), model(x))
    captured, transformed = keraunos.last_prologue_traces(jm)[0], keraunos.last_prologue_traces(jm)[1]
    assert any(MODULE_CHECK in b.tags for b in _checks(captured))
    assert not any(MODULE_CHECK in b.tags for b in _checks(transformed))
    assert [b.args[0].name for b in _checks(transformed) if b.symbol.name == "check_tensor"] == ["x"]
    jm(torch.randn(3, 4))
    assert keraunos.cache_misses(jm) == 2  # argument checks still work


def test_tags_survive_passes_and_a_transform_can_set_them():
    MINE = keraunos.Tag.register("MINE")
    assert keraunos.Tag.register("MINE") is MINE

    class TagSin(keraunos.Transform):
        def transform_traces_pre_prologue(self, prologue, computation, epilogue):
            lines = [b.replace(tags=b.tags | {MINE}) if b.symbol.name == "sin" else b
                     for b in computation.bound_symbols]
            return prologue, computation.with_bound_symbols(lines), epilogue

    model = Block()
    jm = keraunos.jit(nn.Sequential(model), transforms=[TagSin()])
    jf = keraunos.jit(lambda x: x.sin() + x.cos(), transforms=[TagSin()])
    jf(torch.randn(3))
    final = keraunos.last_traces(jf)[-1]
    assert [b.symbol.name for b in final.bound_symbols if MINE in b.tags] == ["sin"]
    jm(torch.randn(2, 4))
    final = keraunos.last_traces(jm)[-1]
    assert [p.name for p in final.params if STATIC_MEMORY_LOCATION not in p.tags] == ["input_"]
    assert INPUT_TENSOR in final.params[0].tags
