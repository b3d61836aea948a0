"""Captured programs kept between processes (keraunos/persist/programs.py): a second process on the
same cache directory loads the program instead of capturing it, and computes what eager does;
anything the program depends on that changed (its code, a global it reads, the module's
structure, an option, the input's dtype) is a miss, and a stored row that does not load is
ignored and written again.

Every run is a real process (the store is for restarts); each prints what ``compile_stats``
says of the program store, whether capture ran, and the results, which the tests compare with
eager's (in that process) and with the first process's. The first process of the tests that
start from the plain model's kept program runs once per module (``kept``); each such test
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


MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    SCALE = 0.5


    def gate(x):
        return torch.nn.functional.silu(x) * SCALE


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return x + gate(self.fc(self.norm(x)))


    class Settings:
        """A plain object the model holds: checked by identity, and its fields by value."""

        def __init__(self, temperature):
            self.temperature = temperature


    class Model(nn.Module):
        def __init__(self, width=16, layers=2, temperature=1.0):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.head = nn.Linear(width, 4)
            self.settings = Settings(temperature)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return (self.head(x) / self.settings.temperature).softmax(-1)
''')

RUN = textwrap.dedent('''
    import copy, json, os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch, keraunos
    import model_def
    torch.set_num_threads(1)
    variant = sys.argv[1]
    torch.manual_seed(0)
    model = model_def.Model(layers=3 if variant == "structure" else 2,
                            temperature=2.0 if variant == "settings" else 1.0)
    reference = copy.deepcopy(model)
    if variant == "hook":  # a hook the stored program was not captured with
        model.blocks[0].register_forward_hook(lambda module, args, out: out * 2)
        reference = copy.deepcopy(model)
    options = {"specialize_data": True} if variant == "option" else {}
    if variant == "fused":
        options = {"executors": ["inductor", "torch"], "fuse": "wait"}
    jitted = keraunos.jit(model, **options)
    dtype = torch.float64 if variant == "dtype" else torch.float32
    if variant == "dtype":
        model.double(); reference.double()
    x = torch.randn(3, 16, dtype=dtype)
    train = variant == "train"
    if train:
        out = jitted(x)
        out.square().sum().backward()
        expected = reference(x)
        expected.square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        for g, p in zip(grads, reference.parameters()):
            torch.testing.assert_close(g, p.grad)
    else:
        with torch.no_grad():
            out = jitted(x)
            expected = reference(x)
        grads = []
    torch.testing.assert_close(out, expected)
    keraunos.persist.programs.wait_for_keeps()  # a captured program is pickled in the background
    stats = keraunos.compile_stats(jitted)
    with torch.no_grad():  # a second call hits the entry, loaded or captured
        again = jitted(x) if not train else None
    resized = []
    if variant == "resize":  # another batch size: automatic dynamic makes it a symbol
        y = torch.randn(5, 16)
        with torch.no_grad():
            torch.testing.assert_close(jitted(y), reference(y))
        resized = keraunos.last_cache_miss_reasons(jitted)
    print(json.dumps({"store": stats.program_store, "captured": "capture" in stats.stages,
                      "misses": keraunos.cache_misses(jitted), "resized": resized,
                      "tier": stats.tier, "hit_path": keraunos.compile_stats(jitted).hit_path,
                      "out": out.detach().double().flatten().tolist(),
                      "grads": [g.double().flatten().tolist() for g in grads]}))
''')


def _write_program(directory):
    (directory / "model_def.py").write_text(MODEL)
    (directory / "run.py").write_text(RUN)
    return directory


@pytest.fixture
def program(tmp_path):
    return _write_program(tmp_path)


@pytest.fixture(scope="module")
def _kept_once(tmp_path_factory):
    """The plain model's first process, once per module: its directory and what it printed."""
    directory = _write_program(tmp_path_factory.mktemp("kept"))
    first = _run(directory)
    assert first["captured"] and first["store"] == "kept", first["store"]
    return directory, first


@pytest.fixture
def kept(_kept_once, tmp_path):
    """``(directory, store, first)``: the plain model's program, kept by a first process in
    ``directory``, in ``store``, a copy of that process's store of this test's own."""
    directory, first = _kept_once
    store = tmp_path / "store"
    shutil.copytree(directory / "store", store)
    return directory, store, first


def _run(directory, variant="plain", store=None) -> dict:
    return run_with_store(directory / "run.py", [variant], store or directory / "store")


def test_a_restart_loads_the_program_and_computes_what_eager_does(kept):
    directory, store, first = kept  # captured and kept by the first process (``_kept_once``)
    assert len(program_rows(store)) == 1
    second = _run(directory, store=store)
    assert second["store"] == "loaded" and not second["captured"], second
    assert second["out"] == first["out"]  # and each equals eager's in its process (run.py)
    assert second["misses"] == 1
    assert second["hit_path"] == first["hit_path"]  # the loaded prologue reads as captured


# A model that reads no module global: its entries take the native hit path (one C call checks
# the call and runs the entry). Prints the hit path and whether the entry was loaded.
NATIVE_RUN = textwrap.dedent('''
    import json, torch, keraunos
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    jitted = keraunos.jit(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), model(x))
        keraunos.persist.programs.wait_for_keeps()
        torch.testing.assert_close(jitted(x), model(x))
    stats = keraunos.compile_stats(jitted)
    print(json.dumps({"store": stats.program_store, "hit_path": stats.hit_path}))
''')


def test_a_loaded_program_takes_the_native_hit_path_as_a_captured_one_does(tmp_path):
    # The prologue's checks of grad mode, autocast and the rest keep what they compare through
    # the store; read as text, they sent every loaded entry to the Python hit path.
    script = tmp_path / "run.py"
    script.write_text(NATIVE_RUN)
    first = run_with_store(script, [], tmp_path / "store")
    second = run_with_store(script, [], tmp_path / "store")
    assert (first["store"], second["store"]) == ("kept", "loaded"), (first, second)
    assert first["hit_path"] == second["hit_path"] == "native", (first, second)


def test_training_loads_forward_and_backward(program):
    first = _run(program, "train")
    assert first["store"] == "kept", first["store"]
    second = _run(program, "train")
    assert second["store"] == "loaded" and not second["captured"], second
    assert second["out"] == first["out"] and second["grads"] == first["grads"]
    assert second["grads"]  # gradients equal eager's in both processes (run.py)


@pytest.mark.parametrize("change", ["code", "global", "structure", "option", "dtype",
                                    "settings"])
def test_what_the_program_depends_on_changing_misses_the_store(kept, change):
    directory, store, _ = kept
    variant, source = "plain", None
    if change == "code":  # the same names and structure, another forward
        source = MODEL.replace("return x + gate(", "return x - gate(")
    elif change == "global":
        source = MODEL.replace("SCALE = 0.5", "SCALE = 0.25")
    else:
        variant = change
    # The changed source at the kept program's own path, for this run only (the directory is
    # the module's: ``_kept_once``).
    if source is not None:
        (directory / "model_def.py").write_text(source)
    try:
        changed = _run(directory, variant, store=store)
    finally:
        (directory / "model_def.py").write_text(MODEL)
    assert changed["captured"] and changed["store"] == "kept", changed
    # A row of its own next to the first one's; a field of an object the model holds is not in
    # the key: the stored program's prologue rejected the call, and the capture replaced it.
    assert len(program_rows(store)) == (1 if change == "settings" else 2)


def test_the_key_covers_every_source_file_of_keraunos():
    """A program stored by another checkout (another capture, other passes) is not loaded: the
    key hashed only the store's own folder, and a fix to capture loaded the programs captured
    before it."""
    import keraunos
    from keraunos.persist import programs
    package = os.path.dirname(keraunos.__file__)
    covered = {os.path.relpath(str(p), package) for p in programs.source_files()}
    for path in ("__init__.py", os.path.join("capture", "recorder.py"),
                 os.path.join("passes", "dce.py"), os.path.join("core", "effects.py"),
                 os.path.join("executors", "fusion", "accumulation.py")):
        assert path in covered, path


@pytest.mark.skipif(compiler.toolchain_problem("cpu") is not None,
                    reason="Inductor cannot build C++ kernels on this machine")
@pytest.mark.long
def test_a_loaded_program_is_fused(program):
    """The claims and the fusion run after a load as after a capture (the regions come from
    the kernel store): the loaded program runs fused and computes what eager does."""
    first = _run(program, "fused")
    assert first["store"] == "kept" and first["tier"] == "fused", first
    second = _run(program, "fused")
    assert second["store"] == "loaded" and second["tier"] == "fused", second
    assert second["out"] == first["out"]


def test_a_loaded_entry_tells_automatic_dynamic_its_sizes(program):
    """After a load, as after a capture, a call of another batch size compiles it as a symbol."""
    first = _run(program, "resize")
    second = _run(program, "resize")
    assert second["store"] == "loaded", second["store"]
    for run in (first, second):
        assert any("recompiled with it symbolic" in r for r in run["resized"]), run["resized"]


def test_a_module_with_hooks_is_neither_kept_nor_loaded(kept):
    """The fast prologue made on a load would check the hooks the module has now: a program
    captured without a hook must not serve a module that has one."""
    directory, store, _ = kept  # kept without a hook by the first process
    # its results equal eager's, hook included (run.py)
    hooked = _run(directory, "hook", store=store)
    assert hooked["captured"] and "hooks" in hooked["store"], hooked["store"]


def _set_value(store, value: bytes, fix_checksum: bool) -> None:
    import hashlib
    with sqlite3.connect(store / "store.sqlite3") as db:
        if fix_checksum:
            db.execute("UPDATE entries SET value = ?, size = ?, checksum = ? WHERE namespace = "
                       "'program'", (value, len(value), hashlib.sha256(value).hexdigest()))
        else:
            db.execute("UPDATE entries SET value = ? WHERE namespace = 'program'", (value,))


@pytest.mark.parametrize("damage", ["truncated", "checksummed garbage", "random"])
def test_a_damaged_stored_program_is_ignored_and_written_again(kept, damage):
    directory, store, first = kept
    (key, value), = program_rows(store)
    if damage == "truncated":  # the checksum no longer matches: the store drops the row
        _set_value(store, value[:len(value) // 2], fix_checksum=False)
    elif damage == "checksummed garbage":  # a row that checksums but does not unpickle
        _set_value(store, value[:len(value) // 2], fix_checksum=True)
    else:
        _set_value(store, os.urandom(len(value)), fix_checksum=True)
    second = _run(directory, store=store)
    assert second["captured"] and second["store"].startswith("kept"), second
    if damage != "truncated":  # a row there that did not load: compile_stats says why
        assert "the stored program was refused (it did not load" in second["store"], second
    assert second["out"] == first["out"]
    (rewritten_key, rewritten), = program_rows(store)
    assert rewritten_key == key and len(rewritten) > 100  # written again, under the same key
    third = _run(directory, store=store)
    assert third["store"] == "loaded" and third["out"] == first["out"]


HELD = textwrap.dedent('''
    import json, os, sys
    import torch, keraunos
    from torch import nn


    def _wrapper_class(fn):
        class Wrapper(nn.Module):  # a class made per function, as the kernels package makes them
            def forward(self, *args):
                return fn(*args) * self.scale
        return Wrapper


    class Model(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            wrapper = _wrapper_class(torch.nn.functional.gelu)()
            wrapper.scale = scale
            # held in a private dict, outside the module tree (transformers' ``_kernel_funcs``)
            self.__dict__["_wrappers"] = {"act": wrapper}

        def forward(self, x):
            return self._wrappers["act"](self.fc(x))


    torch.manual_seed(0)
    model = Model(float(sys.argv[1]))
    jitted = keraunos.jit(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        out, expected = jitted(x), model(x)
    torch.testing.assert_close(out, expected)
    keraunos.persist.programs.wait_for_keeps()
    stats = keraunos.compile_stats(jitted)
    print(json.dumps({"store": stats.program_store, "captured": "capture" in stats.stages,
                      "out": out.double().flatten().tolist()}))
''')


def test_an_object_the_module_holds_outside_its_tree_is_found_again_by_its_place(tmp_path):
    """transformers with the kernels package keeps a module of a class made at run time in a
    private dict of each attention layer, and the prologue checks it by identity: a later
    process finds it at the same place in its own model, and loads the program if its contents
    (class, state, code) are like the kept one's; a different one is captured again."""
    script = tmp_path / "held.py"
    script.write_text(HELD)
    store = tmp_path / "store"
    first = run_with_store(script, ["2.0"], store)
    assert first["store"] == "kept" and first["captured"], first
    second = run_with_store(script, ["2.0"], store)
    assert second["store"] == "loaded" and not second["captured"], second
    assert second["out"] == first["out"]
    other = run_with_store(script, ["3.0"], store)  # the held object's state differs
    assert other["captured"] and other["out"] != first["out"], other
    assert "is not like the one kept" in other["store"], other  # compile_stats says why
