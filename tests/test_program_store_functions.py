"""Jitted functions and symbolic-size entries kept between processes (keraunos/persist/programs.py):
a second process on the same cache directory loads the program instead of capturing it and
computes what eager does (results, in-place effects, gradients); a change of the function's
code, a global it reads, a default or a closure value is a miss; a symbolic entry loaded serves
sizes no process compiled for, and its prologue still rejects what it cannot serve.

Every run is a real process; ``run.py`` compares each call with eager in its own process and
prints what ``compile_stats`` says of the program store, whether capture ran, the misses, the
readable prologue and the results (see tests/test_program_store.py for modules). The first
process of a scenario several tests start from runs once per module (``kept``); each such test
restarts from a copy of the store it wrote, in the same directory (the program's key holds its
source file's path).
"""
import os
import shutil
import sqlite3
import textwrap

import pytest
from helpers import program_rows, run_with_store

from keraunos.executors.fusion import compiler


PROGRAM = textwrap.dedent('''
    import torch

    SCALE = 0.5


    def helper(t):
        return t.sin() + 1


    def step(x, w, buf, scale=0.5):
        buf.mul_(0.9).add_(x.mean(0))  # an in-place effect on an input
        return torch.tanh(x @ w) * scale * SCALE + helper(buf)


    def make(k):
        def scaled(x):
            return x * k + SCALE
        return scaled


    def parity(x):
        # a decision on a size: the symbolic program guards it
        if x.shape[0] % 2 == 0:
            return x.cos()
        return x.sin()


    def accumulate(a, b):
        # in place: what a and b share decides what it computes, or whether it raises
        a.add_(b)
        return b * 2
''')

RUN = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch, keraunos
    import program_def
    torch.set_num_threads(1)
    variant, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    options = {"dynamic": True} if "dynamic" in variant else {}
    tolerance = {}
    if variant.endswith("fused"):  # Inductor's kernels: float32 rounding of their own
        options.update(executors=["inductor", "torch"], fuse="wait")
        tolerance = {"rtol": 1e-4, "atol": 1e-4}
    results, grads, stores, captured, tiers = [], [], [], [], []

    def compare(jitted, eager, make_args, n, train):
        args, reference = make_args(n), make_args(n)
        try:
            expected = eager(*reference)
        except RuntimeError as error:  # then the jitted call raises it too
            try:
                jitted(*args)
            except RuntimeError as jit_error:
                assert str(error) in str(jit_error), (error, jit_error)
            else:
                raise AssertionError(f"eager raised {error}, keraunos did not")
            results.append(f"raised {type(error).__name__}")
            return
        out = jitted(*args)
        torch.testing.assert_close(out, expected, **tolerance)
        for a, r in zip(args, reference):  # in-place effects on the inputs
            torch.testing.assert_close(a, r, **tolerance)
        if train:
            out.square().sum().backward()
            expected.square().sum().backward()
            torch.testing.assert_close(args[1].grad, reference[1].grad, **tolerance)
            grads.append(args[1].grad.double().flatten().tolist())
        results.append(out.detach().double().flatten().tolist())
        keraunos.persist.programs.wait_for_keeps()  # a captured program is pickled in the background
        stats = keraunos.compile_stats(jitted)
        stores.append(stats.program_store)
        tiers.append(stats.tier)
        captured.append("capture" in stats.stages and stats.last_call_compiled)

    def step_args(n):
        torch.manual_seed(n)
        return (torch.randn(n, 8), torch.randn(8, 8, requires_grad=True), torch.randn(8))

    if variant.startswith("step"):
        fn, make_args = program_def.step, step_args
    elif variant.startswith("closure"):
        fn = program_def.make(float(os.environ.get("CLOSURE_K", "2.0")))
        make_args = lambda n: (torch.randn(n, 8, generator=torch.Generator().manual_seed(n)),)
    elif variant.startswith("parity"):
        fn = program_def.parity
        make_args = lambda n: (torch.randn(n, 4, generator=torch.Generator().manual_seed(n)),)
    elif variant.startswith("accumulate"):  # its two inputs share memory, or not
        fn = program_def.accumulate

        def make_args(n):
            # Inputs that require grad: the program works on copies, and writes back after.
            leaf = torch.randn(n + 1, 4, generator=torch.Generator().manual_seed(n))
            x = leaf.requires_grad_().clone()
            if "overlapping" in variant:  # eager raises on the write
                return x[:-1], x[1:]
            x = x[:-1].clone()
            if "same memory" in variant:  # two views of one memory: b sees the write
                return x, x.view(n, 4)
            return x, x.clone()
    elif variant == "module closure":  # a closure holding a module, its weights and width
        torch.manual_seed(int(os.environ.get("CLOSURE_SEED", "0")))
        linear = torch.nn.Sequential(torch.nn.Linear(8, int(os.environ.get("CLOSURE_WIDTH", "8"))),
                                     torch.nn.LayerNorm(int(os.environ.get("CLOSURE_WIDTH", "8"))))
        fn = lambda x: linear(x).relu()
        make_args = lambda n: (torch.randn(n, 8, generator=torch.Generator().manual_seed(n)),)
    jitted = keraunos.jit(fn, **options)
    for n in sizes:
        compare(jitted, fn, make_args, n, train=variant.startswith("step"))
    print(json.dumps({"stores": stores, "captured": captured, "results": results,
                      "grads": grads, "misses": keraunos.cache_misses(jitted), "tiers": tiers,
                      "reasons": keraunos.last_cache_miss_reasons(jitted),
                      "prologue": str(keraunos.last_prologue_traces(jitted)[0])}))
''')


def _write_program(directory):
    (directory / "program_def.py").write_text(PROGRAM)
    (directory / "run.py").write_text(RUN)
    return directory


@pytest.fixture
def program(tmp_path):
    return _write_program(tmp_path)


@pytest.fixture(scope="module")
def _kept_once(tmp_path_factory):
    """One directory per module, and the first process of each variant run in it, once:
    ``{variant: (store, what it printed)}``."""
    directory = _write_program(tmp_path_factory.mktemp("kept"))
    return directory, {}


@pytest.fixture
def kept(_kept_once, tmp_path):
    """``kept(variant)`` -> ``(directory, store, first)``: the program of ``variant`` at size 5,
    kept by a first process in ``directory``, in ``store``, a copy of that process's store of
    this test's own."""
    directory, firsts = _kept_once

    def copy_of(variant):
        if variant not in firsts:
            first_store = directory / ("store-" + variant.replace(" ", "-"))
            first = _run(directory, variant, store=first_store)
            assert first["stores"] == ["kept"] and first["captured"] == [True], first
            firsts[variant] = first_store, first
        first_store, first = firsts[variant]
        store = tmp_path / "store"
        shutil.copytree(first_store, store)
        return directory, store, first
    return copy_of


def _run(directory, variant: str, sizes=(5,), env=None, store=None) -> dict:
    return run_with_store(directory / "run.py", [variant, ",".join(map(str, sizes))],
                          store or directory / "store", env)


def _without_header(prologue: str) -> list[str]:
    return [line for line in prologue.splitlines() if not line.startswith("#")]


def test_a_restart_loads_a_jitted_function_with_its_effects_and_gradients(kept):
    directory, store, first = kept("step")  # captured and kept by the first process
    second = _run(directory, "step", store=store)
    assert second["stores"] == ["loaded"] and second["captured"] == [False], second
    # each process compared results, the buffer's in-place update and w's gradient with eager
    assert second["results"] == first["results"] and second["grads"] == first["grads"]
    assert second["misses"] == 1


def test_a_restart_loads_a_closure_with_the_same_cell_values(kept):
    directory, store, _ = kept("closure")
    second = _run(directory, "closure", store=store)
    assert second["stores"] == ["loaded"] and second["captured"] == [False], second


@pytest.mark.parametrize("change", ["code", "helper code", "global", "default", "closure value"])
def test_what_a_function_depends_on_changing_misses_the_store(kept, change):
    variant = "closure" if change == "closure value" else "step"
    directory, store, first = kept(variant)
    env, source = None, None
    if change == "code":
        source = PROGRAM.replace("torch.tanh(", "torch.sigmoid(")
    elif change == "helper code":
        source = PROGRAM.replace("t.sin() + 1", "t.sin() + 2")
    elif change == "global":
        source = PROGRAM.replace("SCALE = 0.5", "SCALE = 0.25")
    elif change == "default":
        source = PROGRAM.replace("scale=0.5", "scale=0.75")
    else:
        env = {"CLOSURE_K": "3.0"}
    # The changed source at the kept program's own path, for this run only (the directory is
    # the module's: ``_kept_once``).
    if source is not None:
        (directory / "program_def.py").write_text(source)
    try:
        changed = _run(directory, variant, env=env, store=store)
    finally:
        (directory / "program_def.py").write_text(PROGRAM)
    assert changed["stores"] == ["kept"] and changed["captured"] == [True], changed
    assert changed["results"] != first["results"]  # and each equals eager's in its process
    assert len(program_rows(store)) == 2  # a row of its own: the key changed


def test_a_symbolic_entry_loaded_serves_a_size_no_process_compiled(kept):
    directory, store, first = kept("step dynamic")  # kept at the size 5
    second = _run(directory, "step dynamic", sizes=(9, 13), store=store)
    assert second["stores"] == ["loaded", "loaded"] and second["captured"] == [False, False]
    assert second["misses"] == 1  # 13 served by the loaded entry, as 9 was
    # The prologue's checks (the ShapeEnv's guards, the symbolic tensor checks) are the same
    # program in both processes.
    assert _without_header(second["prologue"]) == _without_header(first["prologue"])
    assert "s0 = x.shape[0]" in second["prologue"]


@pytest.mark.skipif(compiler.toolchain_problem("cpu") is not None,
                    reason="Inductor cannot build C++ kernels on this machine")
@pytest.mark.long
def test_a_loaded_symbolic_entry_is_fused_on_its_rebuilt_shape_env(program):
    """The fusion executor compiles a loaded symbolic program's regions on the ShapeEnv the load
    rebuilt, as on the capture's: fused, and equal to eager (forward and gradient)."""
    first = _run(program, "step dynamic fused", sizes=(5,))
    assert first["stores"] == ["kept"] and first["tiers"] == ["fused"], first
    second = _run(program, "step dynamic fused", sizes=(9, 13))
    assert second["stores"] == ["loaded", "loaded"] and second["tiers"] == ["fused", "fused"]
    assert second["misses"] == 1


def test_automatic_dynamic_loads_the_symbolic_entry_of_a_changed_size(program):
    """The second size of a restart makes the dimension symbolic, as in the process that kept
    it: the symbolic entry is loaded and serves a third size, with the same miss reason."""
    first = _run(program, "step", sizes=(5, 7))
    assert first["stores"] == ["kept", "kept"] and first["captured"] == [True, True], first
    second = _run(program, "step", sizes=(5, 11, 17))
    assert second["stores"] == ["loaded"] * 3 and second["captured"] == [False] * 3, second
    assert second["misses"] == 2
    for run in (first, second):
        assert any("recompiled with it symbolic" in r for r in run["reasons"]), run["reasons"]


def test_a_loaded_symbolic_prologue_rejects_what_its_program_cannot_serve(program):
    """Captured for an even size, the program guards ``s0 % 2 == 0``: loaded, it serves another
    even size, and an odd one (and the size 1, never symbolic) is captured anew."""
    assert _run(program, "parity dynamic", sizes=(4,))["stores"] == ["kept"]
    second = _run(program, "parity dynamic", sizes=(6, 7, 1))
    assert second["stores"][0] == "loaded" and second["captured"] == [False, True, True], second
    assert second["misses"] == 3  # each compared with eager: cos for 6, sin for 7 and 1


def test_programs_of_calls_that_share_memory_otherwise_are_rows_of_their_own(program):
    """How the call's tensors share memory is in the key: the program of shared inputs does
    not overwrite the row of inputs of their own, so a later process with inputs of their own
    still loads (before, the second capture replaced the first row, and it captured again)."""
    assert _run(program, "accumulate", sizes=(5,))["stores"] == ["kept"]
    shared = _run(program, "accumulate same memory", sizes=(5,))
    assert shared["captured"] == [True], shared
    assert len(program_rows(program / "store")) == 2
    again = _run(program, "accumulate", sizes=(5,))
    assert again["stores"] == ["loaded"] and again["captured"] == [False], again


def test_a_loaded_program_serves_only_inputs_that_share_memory_as_it_was_captured(program):
    """The row holds how the capturing call's inputs shared memory (over what its prologue
    returned), and a call whose inputs share it otherwise captures anew. Kept for inputs of
    their own, ``accumulate`` works on copies of inputs that require grad and would hand back
    the ``b`` from before the write, where eager's ``b`` is ``a`` itself (each process compares
    with eager)."""
    assert _run(program, "accumulate", sizes=(5,))["stores"] == ["kept"]
    again = _run(program, "accumulate", sizes=(5,))
    assert again["stores"] == ["loaded"] and again["captured"] == [False], again
    shared = _run(program, "accumulate same memory", sizes=(5,))
    assert shared["captured"] == [True], shared
    # eager: b is x + x after the write, and the result 4x (2x with inputs of their own)
    assert shared["results"] == [[2 * v for v in again["results"][0]]]


def test_a_loaded_symbolic_program_raises_on_overlapping_inputs_as_eager_does(program):
    """Fuzz case 16100:160: a symbolic key leaves out the strides and offsets of symbolic
    tensors, so two overlapping views of one tensor have the key of two tensors of their own;
    eager's ``a.add_(b)`` raises on them, and the loaded program must not run instead."""
    assert _run(program, "accumulate dynamic", sizes=(5,))["stores"] == ["kept"]
    overlapping = _run(program, "accumulate overlapping dynamic", sizes=(5, 7))
    assert overlapping["results"] == ["raised RuntimeError"] * 2, overlapping


def test_a_function_closing_over_a_module_is_loaded_with_the_modules_weights_of_its_process(
        program):
    """The module a function closes over is part of the key by its structure (classes, flags,
    parameters' metadata) and found again in the loading process's closure: its weights are
    that process's (each process compares with eager)."""
    assert _run(program, "module closure")["stores"] == ["kept"]
    again = _run(program, "module closure")
    assert again["stores"] == ["loaded"] and again["captured"] == [False], again
    other_weights = _run(program, "module closure", env={"CLOSURE_SEED": "1"})
    assert other_weights["stores"] == ["loaded"], other_weights
    assert other_weights["results"] != again["results"]
    wider = _run(program, "module closure", env={"CLOSURE_WIDTH": "16"})
    assert wider["stores"] == ["kept"] and wider["captured"] == [True], wider


def _set_value(store, value: bytes) -> None:
    import hashlib
    with sqlite3.connect(store / "store.sqlite3") as db:
        db.execute("UPDATE entries SET value = ?, size = ?, checksum = ? WHERE namespace = "
                   "'program'", (value, len(value), hashlib.sha256(value).hexdigest()))


@pytest.mark.parametrize("variant", ["step", "step dynamic"])
def test_a_damaged_stored_function_program_is_ignored_and_written_again(kept, variant):
    directory, store, first = kept(variant)
    (key, value), = program_rows(store)
    _set_value(store, os.urandom(len(value)))
    second = _run(directory, variant, store=store)
    assert second["captured"] == [True], second
    (note,) = second["stores"]  # kept again, saying why the row there was not used
    assert note.startswith("kept; the stored program was refused (it did not load"), note
    assert second["results"] == first["results"]
    third = _run(directory, variant, store=store)
    assert third["stores"] == ["loaded"] and third["results"] == first["results"]


TRAIN_STEP = textwrap.dedent('''
    import copy, json, os
    import torch, torch.nn as nn, torch.nn.functional as F
    import keraunos
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)
    reference_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(reference_optimizer, 10)


    def train_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        return loss


    def reference_step(x, y):
        reference_optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        reference_optimizer.step()
        reference_scheduler.step()
        return loss


    for _ in range(int(os.environ.get("EAGER_STEPS", "0"))):  # a run resumed at a later step
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        train_step(x, y), reference_step(x, y)
    jitted = keraunos.jit(train_step)
    stores, captured, losses = [], [], []
    for n in range(4):
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        loss, expected = jitted(x, y), reference_step(x, y)
        torch.testing.assert_close(loss, expected)
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, r)
            torch.testing.assert_close(p.grad, r.grad)
            for key, value in reference_optimizer.state[r].items():
                torch.testing.assert_close(optimizer.state[p][key], value)
        keraunos.persist.programs.wait_for_keeps()
        stats = keraunos.compile_stats(jitted)
        stores.append(stats.program_store)
        captured.append("capture" in stats.stages and stats.last_call_compiled)
        losses.append(loss.item())
    print(json.dumps({"stores": stores, "captured": captured, "losses": losses,
                      "misses": keraunos.cache_misses(jitted)}))
''')


def test_a_restart_loads_a_whole_training_step_and_trains_as_eager_does(tmp_path):
    """AdamW, clipping and a cosine schedule in one step. Its prologue checks each gradient its
    ``zero_grad`` sets to None before the program reads it (tensors it checks but does not hand
    on, which a load retargets as any other), and the optimizer's state, whose values change on
    every step: a process resumed at another step loads the program kept by the first."""
    (tmp_path / "train.py").write_text(TRAIN_STEP)
    store = tmp_path / "store"
    first = run_with_store(tmp_path / "train.py", [], store)
    # the first call makes the optimizer's state (not a program); the second is captured, and
    # the third again, the rate a symbol since it changed; each kept, the last in the row
    assert first["stores"][1:] == ["kept"] * 3, first
    assert first["captured"] == [False, True, True, False], first
    second = run_with_store(tmp_path / "train.py", [], store, env={"EAGER_STEPS": "3"})
    assert second["stores"] == ["loaded"] * 4 and second["captured"] == [False] * 4, second
    assert second["misses"] == 1  # each call compared with eager in its own process
