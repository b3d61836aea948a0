"""Traces are readable, valid Python that says what ran; the passes; tags; stats and profiling."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import keraunos


def line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "line_of(" not in line:
                return i
    raise AssertionError(marker)


def program(x, w):
    h = x @ w  # MARK-matmul
    return F.gelu(h).sum(-1)


def jitted_program():
    jf = keraunos.jit(program)
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    assert_close(jf(x, w), program(x, w))
    return jf


def code_lines(trace):
    """The trace's lines of code, without comments (which quote the user's source)."""
    return [line.split("  # ")[0] for line in str(trace).splitlines()
            if not line.strip().startswith("#")]


def count(trace, text):
    return sum(line.count(text) for line in code_lines(trace))


# --------------------------------------------------------------------------- valid Python
def test_every_trace_prints_as_valid_python():
    jf = jitted_program()
    traces = (keraunos.last_prologue_traces(jf) + keraunos.last_traces(jf)
              + keraunos.last_epilogue_traces(jf))
    for trace in traces:
        compile(str(trace), "<trace>", "exec")


def test_module_traces_print_as_valid_python():
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Dropout(0.1))
    jm = keraunos.jit(m)
    jm(torch.randn(2, 8))
    for trace in (keraunos.last_prologue_traces(jm) + keraunos.last_traces(jm)
                  + keraunos.last_epilogue_traces(jm)):
        compile(str(trace), "<trace>", "exec")


def test_inplace_and_structured_return_traces_print_as_valid_python():
    def f(x, d):
        x.add_(1)
        x[0] = 3
        return {"a": (x, d["y"] * 2), "b": [x.sum()]}

    jf = keraunos.jit(f)
    jf(torch.randn(3), {"y": torch.randn(2)})
    for trace in (keraunos.last_prologue_traces(jf) + keraunos.last_traces(jf)
                  + keraunos.last_epilogue_traces(jf)):
        compile(str(trace), "<trace>", "exec")


def test_final_computation_trace_runs_as_printed():
    jf = jitted_program()
    final = keraunos.last_traces(jf)[-1]
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    out = final.python_callable()(x, w)
    assert_close(out[0], program(x, w))


def test_trace_shows_shapes_and_dtypes():
    jf = jitted_program()
    text = str(keraunos.last_traces(jf)[-1])
    assert "f32[2, 8]" in text
    assert "f32[8, 8]" in text
    assert "f32[2]" in text


def test_trace_shows_user_source_file_line_and_code():
    jf = jitted_program()
    text = str(keraunos.last_traces(jf)[-1])
    assert f"{__file__}:{line_of('MARK-matmul')}" in text, text
    assert "h = x @ w" in text


def test_trace_names_inputs_after_parameters_and_provenance():
    jf = jitted_program()
    final = keraunos.last_traces(jf)[-1]
    assert [p.name for p in final.params] == ["x", "w"]
    assert "args[0]" in str(final) and "args[1]" in str(final)


def test_module_trace_shows_parameter_provenance():
    m = nn.Sequential(nn.Linear(4, 4))
    jm = keraunos.jit(m)
    jm(torch.randn(2, 4))
    text = str(keraunos.last_traces(jm)[-1])
    assert "module.0.weight" in text and "module.0.bias" in text


def test_trace_headers_name_the_passes():
    jf = jitted_program()
    text = str(keraunos.last_traces(jf)[-1])
    assert "# Constructed by capture" in text
    assert "# Constructed by Dead Code Elimination" in text
    assert "# Constructed by Common Subexpression Elimination" in text


def test_last_traces_is_one_trace_per_pass():
    jf = jitted_program()
    traces = keraunos.last_traces(jf)
    assert isinstance(traces, list) and len(traces) >= 4
    for i, trace in enumerate(traces):
        assert isinstance(trace, keraunos.Trace)
        assert len(trace.header) == i + 1
        if i:
            assert trace.header[:-1] == traces[i - 1].header
    assert traces[0].header == ["Constructed by capture"]


def test_prologue_shows_checks_and_epilogue_rebuilds_return():
    jf = keraunos.jit(lambda x, s: (x * s, {"k": x}))
    jf(torch.randn(2, 3), 2.0)
    prologue = str(keraunos.last_prologue_traces(jf)[0])
    assert "def prologue(*args, **kwargs):" in prologue
    assert "2.0" in prologue and "(2, 3)" in prologue
    epilogue = str(keraunos.last_epilogue_traces(jf)[-1])
    assert "def epilogue(" in epilogue and "'k'" in epilogue


def test_traces_follow_the_entry_that_ran_on_cache_hits():
    jf = keraunos.jit(lambda x: x.exp(), dynamic=False)  # every shape an entry of its own
    jf(torch.randn(2, 3))
    jf(torch.randn(5, 7))
    assert "f32[5, 7]" in str(keraunos.last_traces(jf)[-1])
    jf(torch.randn(2, 3))
    assert keraunos.cache_hits(jf) == 1
    text = str(keraunos.last_traces(jf)[-1])
    assert "f32[2, 3]" in text and "f32[5, 7]" not in text
    assert "(2, 3)" in str(keraunos.last_prologue_traces(jf)[0])


def test_traces_are_not_mutated_by_later_passes():
    jf = keraunos.jit(lambda x: (x.sin(), x.sin(), x.cos()))
    jf(torch.randn(3))
    capture = keraunos.last_traces(jf)[0]
    assert count(capture, ".sin(") == 2


# ------------------------------------------------------------------------------------ passes
def test_cse_merges_duplicate_ops():
    def f(x):
        a = x.sin()
        b = x.sin()
        return a + b

    jf = keraunos.jit(f)
    x = torch.randn(4)
    assert_close(jf(x), f(x))
    assert count(keraunos.last_traces(jf)[0], ".sin(") == 2
    assert count(keraunos.last_traces(jf)[-1], ".sin(") == 1


def test_cse_merges_duplicate_function_calls_with_same_constants():
    def f(x):
        return F.softmax(x, dim=-1) + F.softmax(x, dim=-1) + F.softmax(x, dim=0)

    jf = keraunos.jit(f)
    x = torch.randn(3, 3)
    assert_close(jf(x), f(x))
    assert count(keraunos.last_traces(jf)[-1], "softmax(") == 2


def test_cse_never_merges_random_ops():
    def f(x):
        return x + torch.rand(3), x + torch.rand(3)

    jf = keraunos.jit(f)
    x = torch.zeros(3)
    torch.manual_seed(0)
    expected = f(x)
    torch.manual_seed(0)
    a, b = jf(x)
    assert_close((a, b), expected)
    assert not torch.equal(a, b)
    assert count(keraunos.last_traces(jf)[-1], "torch.rand(") == 2


def test_cse_never_merges_across_inplace_write_to_input():
    def f(x):
        a = x.sin()
        x.add_(1)
        b = x.sin()
        return a, b

    jf = keraunos.jit(f)
    x = torch.randn(3)
    x_copy = x.clone()
    assert_close(jf(x), f(x_copy))
    assert_close(x, x_copy)
    assert count(keraunos.last_traces(jf)[-1], ".sin(") == 2


def test_cse_never_merges_across_inplace_write_to_intermediate():
    def f(x):
        y = x * 2
        a = y.exp()
        y.add_(1)
        b = y.exp()
        return a, b

    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x), f(x))
    assert count(keraunos.last_traces(jf)[-1], ".exp(") == 2


def test_cse_never_merges_across_write_to_a_view():
    def f(x):
        y = x * 1
        a = y.sum()
        y[0].fill_(100)
        b = y.sum()
        return a, b

    jf = keraunos.jit(f)
    x = torch.randn(3)
    assert_close(jf(x), f(x))


def test_dce_drops_unused_ops():
    def f(x):
        unused = x.cos() * 3  # noqa: F841
        return x.sin()

    jf = keraunos.jit(f)
    jf(torch.randn(3))
    assert count(keraunos.last_traces(jf)[0], ".cos(") == 1
    final = "\n".join(code_lines(keraunos.last_traces(jf)[-1]))
    assert ".cos(" not in final and ".mul(" not in final and " * 3" not in final


def test_dce_keeps_unused_random_ops():
    def f(x):
        torch.randn(2)
        return x + 1

    jf = keraunos.jit(f)
    jf(torch.randn(3))
    assert count(keraunos.last_traces(jf)[-1], "torch.randn(") == 1


def test_dce_keeps_inplace_writes_to_inputs():
    def f(x):
        x.mul_(2)
        return None

    jf = keraunos.jit(f)
    x = torch.ones(3)
    jf(x)
    assert_close(x, torch.full((3,), 2.0))


def test_final_trace_deletes_intermediates():
    def f(x):
        a = x.sin()
        b = a.cos()
        c = b.exp()
        return c + 1

    jf = keraunos.jit(f)
    jf(torch.randn(3))
    final = str(keraunos.last_traces(jf)[-1])
    assert "del " in final
    deleted = {name.strip() for line in final.splitlines() if line.strip().startswith("del ")
               for name in line.strip()[4:].split(",")}
    assert len(deleted) >= 3
    assert "x" not in deleted  # inputs belong to the caller


# -------------------------------------------------------------------------------------- tags
def test_parameters_and_buffers_carry_static_memory_location_tag():
    m = nn.BatchNorm1d(4).eval()
    jm = keraunos.jit(m)
    jm(torch.randn(2, 4))
    params = {p.name: p for p in keraunos.last_traces(jm)[-1].params}
    static = {n for n, p in params.items() if keraunos.STATIC_MEMORY_LOCATION in p.tags}
    assert len(static) == 4  # weight, bias, running_mean, running_var
    inputs = [p for p in params.values() if keraunos.STATIC_MEMORY_LOCATION not in p.tags]
    assert len(inputs) == 1 and "args[0]" in inputs[0].provenance


def test_function_arguments_do_not_carry_static_memory_location_tag():
    jf = jitted_program()
    for p in keraunos.last_traces(jf)[-1].params:
        assert keraunos.STATIC_MEMORY_LOCATION not in p.tags


def test_static_memory_location_is_a_registered_tag():
    assert keraunos.Tag.register("STATIC_MEMORY_LOCATION") is keraunos.STATIC_MEMORY_LOCATION


# ----------------------------------------------------------------------- stats and profiling
def test_compile_stats_have_capture_and_codegen_times():
    jf = jitted_program()
    stats = keraunos.compile_stats(jf)
    for stage in ("capture", "codegen"):
        assert isinstance(stats.stages[stage], float) and stats.stages[stage] >= 0
    assert stats.compile_time > 0
    assert stats.last_cache_lookup > 0
    assert (stats.cache_misses, stats.cache_hits) == (1, 0)
    assert "capture" in str(stats)


def test_compile_stats_last_cache_lookup_on_hit():
    jf = jitted_program()
    jf(torch.randn(2, 8), torch.randn(8, 8))
    stats = keraunos.compile_stats(jf)
    assert stats.last_cache_lookup > 0
    assert (stats.cache_misses, stats.cache_hits) == (1, 1)


def test_profile_true_gives_eager_results_and_named_profiler_ranges():
    jf = keraunos.jit(program, profile=True)
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    assert_close(jf(x, w), program(x, w))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = jf(x, w)
    assert_close(out, program(x, w))
    names = {e.name for e in prof.events()}
    assert "keraunos.get_computation_and_inputs" in names, sorted(names)[:20]
    assert "keraunos.computation" in names


def test_profile_false_adds_no_profiler_ranges():
    jf = keraunos.jit(program, profile=False)
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    jf(x, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        jf(x, w)
    assert not any(e.name.startswith("keraunos.") for e in prof.events())


def test_profile_env_variable_turns_profiling_on(monkeypatch):
    monkeypatch.setenv("KERAUNOS_PROFILE", "1")
    jf = keraunos.jit(program)
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    jf(x, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        jf(x, w)
    assert "keraunos.get_computation_and_inputs" in {e.name for e in prof.events()}


def test_every_random_op_name_still_finds_an_op_in_pytorch():
    """The random-op set is built from names once; a rename in PyTorch must fail here, not drop
    the op from the set silently (then CSE could merge two draws)."""
    from keraunos.core.effects import random_ops
    missing = [name for name, ops in random_ops().items() if not ops]
    assert missing == []


def test_random_ops_are_known_by_object_and_attention_only_with_dropout():
    from keraunos.core.effects import is_random
    from keraunos.capture.naming import torch_symbol
    assert is_random(torch_symbol(torch.nn.functional.dropout))
    assert is_random(torch_symbol(torch.Tensor.uniform_))
    assert is_random(torch_symbol(torch.ops.aten.bernoulli.p))
    assert not is_random(torch_symbol(torch.exp))
    # seeded, but draws only when dropout_p != 0: the call decides
    assert not is_random(torch_symbol(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default))


def test_dropout_in_eval_mode_or_with_p_zero_is_no_line_and_draws_nothing():
    """Eval-mode dropout returns its input and leaves the generator alone (eager's ATen returns
    early): it is no random line, so DCE, CSE and fusion treat it as the identity it is."""
    from keraunos.core.effects import draws_random
    from keraunos.capture.naming import torch_symbol
    F = torch.nn.functional
    x = torch.randn(3)
    assert not draws_random(torch_symbol(F.dropout), (x, 0.1), {"training": False})
    assert not draws_random(torch_symbol(F.dropout), (x, 0.0), {})
    assert not draws_random(torch_symbol(F.alpha_dropout), (x, 0.2), {})  # training=False default
    assert not draws_random(torch_symbol(torch.dropout), (x, 0.2, False), {})
    assert draws_random(torch_symbol(F.dropout), (x, 0.1), {})
    assert draws_random(torch_symbol(torch.dropout), (x, 0.2, True), {})

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.GELU())
    jm = keraunos.jit(model.eval())
    with torch.no_grad():
        state = torch.get_rng_state()
        out = jm(torch.ones(2, 4))
        assert torch.equal(torch.get_rng_state(), state)
        torch.testing.assert_close(out, model(torch.ones(2, 4)))
    assert "dropout" not in str(keraunos.last_traces(jm)[-1])
    model.train()  # now it draws: eager's values under the same seed
    torch.manual_seed(3)
    mine = jm(torch.ones(2, 4))
    torch.manual_seed(3)
    torch.testing.assert_close(mine, model(torch.ones(2, 4)))
    assert "bernoulli" in str(keraunos.last_traces(jm)[-1])
