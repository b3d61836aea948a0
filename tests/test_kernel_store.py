"""Built kernels survive a restart: a second process on the same Inductor cache directory
builds no C++ kernel the first one built.

Each process here is a real cold start (a fresh ``TORCHINDUCTOR_CACHE_DIR``, so Inductor's probe
of the vector instructions test-builds with g++ while keraunos captures the program: the race the
first test guards against needs exactly that).
"""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from keraunos.executors.fusion import compiler, warming

PROGRAM = textwrap.dedent("""
    import copy, torch, keraunos
    from keraunos.examples.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)).eval()
    jitted = keraunos.jit(copy.deepcopy(model), executors=["inductor", "torch"], fuse=FUSE)
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), model(x), rtol=1e-4, atol=1e-4)
        keraunos.wait_for_fusion(jitted)
        torch.testing.assert_close(jitted(x), model(x), rtol=1e-4, atol=1e-4)
    assert keraunos.compile_stats(jitted).tier == "fused", keraunos.compile_stats(jitted)
    print("ok")
""")


def _built(cache_dir) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), cache_dir)
            for d, _, names in os.walk(cache_dir) for n in names if n.endswith(".so")}


def _run(script, cache_dir) -> None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "KERAUNOS_FUSE": ""}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(compiler.toolchain_problem("cpu") is not None,
                    reason="Inductor cannot build C++ kernels on this machine")
@pytest.mark.long
@pytest.mark.parametrize("fuse", ["wait", "background"])
def test_a_restart_rebuilds_no_kernel(tmp_path, fuse):
    """The key of a C++ build holds the compiler's flags. Inductor's first probe of the CPU's
    vector instructions, run on two threads at once (keraunos's warming thread and the first
    compile), left ``-mavx512bf16`` in the flags twice for the whole process, so every kernel of a
    cold process was keyed apart from the same kernel in any later one: a restart rebuilt them
    all (12 of 12 on the 4-layer training step; 5 of 5 on this one-layer GPT, which met the race
    in every cold run tried, where a one-line function did not). A cold process, then a restart.
    The probe starts at ``keraunos.jit`` and a compile lowers while it builds (both modes): the
    picks take turns at the candidate list's lock."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.replace("FUSE", repr(fuse)))
    cache = tmp_path / "inductor"
    _run(script, cache)
    first = _built(cache)
    assert first, "the first process built no kernel: nothing was tested"
    _run(script, cache)
    assert _built(cache) == first, f"rebuilt on restart: {sorted(_built(cache) - first)}"


def test_every_probe_keraunos_starts_goes_through_one_lock(monkeypatch):
    """Two probes keraunos starts (two threads loading or compiling regions) never run
    Inductor's first probe at once: the second waits on the lock the first holds."""
    import threading
    from torch._inductor import cpu_vec_isa
    inside, release, order = threading.Event(), threading.Event(), []

    def slow_probe():
        order.append("start")
        inside.set()
        release.wait(30)
        order.append("end")
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", slow_probe)
    first = threading.Thread(target=warming.probe_vector_isa)
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=warming.probe_vector_isa)
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second probe did not wait for the first"
    release.set()
    first.join(30)
    second.join(30)
    assert order == ["start", "end", "start", "end"]


def test_a_compile_lowers_while_the_probe_builds_and_picks_after_it(monkeypatch):
    """A probe under way holds the candidate list while it test-builds; a compile on another
    thread does not wait for it before lowering (``before_the_first_pick`` returns),
    and its own pick waits for the build and gets the same ISA."""
    import threading
    from torch._inductor import cpu_vec_isa

    from keraunos.executors.fusion.isa_probe import CandidateList
    building, release, log = threading.Event(), threading.Event(), []

    class Slow(_Candidate):
        def __bool__(self):
            building.set()
            release.wait(30)
            return super().__bool__()
    candidates = CandidateList([Slow("avx512", True, log), _Candidate("avx2", True, log)])

    def valid_vec_isa_list():
        return candidates
    valid_vec_isa_list._keraunos_lazy = True
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    from keraunos.executors.fusion import isa_probe
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", cpu_vec_isa.VecISA._probe_load)
    picked = []
    probe = threading.Thread(target=lambda: picked.append(str(cpu_vec_isa.pick_vec_isa())))
    probe.start()
    assert building.wait(30)
    lowering = threading.Thread(target=warming.before_the_first_pick)
    lowering.start()
    lowering.join(10)
    assert not lowering.is_alive(), "the compile waited for the probe before lowering"
    pick = threading.Thread(target=lambda: picked.append(str(cpu_vec_isa.pick_vec_isa())))
    pick.start()
    pick.join(0.3)
    assert pick.is_alive(), "a pick did not wait for the probe's build"
    release.set()
    probe.join(30)
    pick.join(30)
    assert picked == ["avx512", "avx512"] and log == ["avx512"]


def test_a_region_missing_from_the_store_does_not_wait_for_the_probe(own_store, monkeypatch):
    def refuse():
        raise AssertionError("waited for the probe to find nothing in the store")
    monkeypatch.setattr(warming, "probe_vector_isa", refuse)
    assert compiler._load_stored("0" * 64, lambda: None, "inductor_region0") is None


def test_a_library_that_loaded_before_is_not_probed_again(tmp_path):
    """Inductor starts a Python child per candidate instruction set to load its test library
    (ten on an AVX-512 machine, 1.4 s a process): a load that worked is remembered in the store
    under the library's bytes, so the next process starts none; a failed one is asked again."""
    from keraunos.executors.fusion import isa_probe
    from keraunos.persist.store import Store
    where = Store(tmp_path / "store")
    library = tmp_path / "probe.so"
    library.write_bytes(b"\x7fELF one build")
    calls = []

    def probe(isa, path, result=True):
        calls.append(path)
        return result
    assert isa_probe.remembered(probe, "avx512", str(library), where)
    assert isa_probe.remembered(probe, "avx512", str(library), where)
    assert len(calls) == 1, "a load that worked was probed again"
    library.write_bytes(b"\x7fELF another build")  # rebuilt: its bytes decide, not its name
    assert isa_probe.remembered(probe, "avx512", str(library), where)
    assert len(calls) == 2
    failing = tmp_path / "fails.so"
    failing.write_bytes(b"not a library")
    for _ in range(2):
        assert not isa_probe.remembered(lambda i, p: probe(i, p, False), "amx", str(failing), where)
    assert len(calls) == 4, "a failed load was remembered"
    assert isa_probe.remembered(probe, "avx2", str(tmp_path / "missing.so"), where)
    assert len(calls) == 5  # a library that cannot be read is always probed


def test_the_probe_runs_as_inductors_own_when_the_store_cannot_be_used(tmp_path):
    from keraunos.executors.fusion import isa_probe
    from keraunos.persist.store import Store
    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    library = tmp_path / "probe.so"
    library.write_bytes(b"\x7fELF")
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        where = Store(blocked / "store")
        for _ in range(2):
            assert isa_probe.remembered(lambda i, p: calls.append(p) or True, "avx512",
                                        str(library), where)
    assert len(calls) == 2


# Inductor's region modules kept in the store (executors/fusion/kernel_store.py): a later process
# loads a region's kernel without compile_fx. A "later process" here is this one with its
# in-process kernels forgotten and a store of the test's own.

needs_cxx = pytest.mark.skipif(compiler.toolchain_problem("cpu") is not None,
                               reason="Inductor cannot build C++ kernels on this machine")


@pytest.fixture
def own_store(tmp_path, monkeypatch):
    """A store of this test's own, and no kernel compiled before it in this process."""
    from keraunos.persist import store
    monkeypatch.setattr(store, "_default", store.Store(tmp_path / "store"))
    monkeypatch.setattr(compiler, "_kernels", {})
    return store._default


def _gpt():
    import copy
    from keraunos.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).eval()
    return model, copy.deepcopy(model), torch.randint(0, 256, (1, 8))


def copy_of(model):
    import copy
    return copy.deepcopy(model)


def _no_compile_fx(monkeypatch):
    from torch._inductor import compile_fx

    def refuse(*args, **kwargs):
        raise AssertionError("compile_fx ran although the store holds the region")
    monkeypatch.setattr(compile_fx, "compile_fx", refuse)


def _fused_run(model, x):
    import keraunos
    jitted = keraunos.jit(model, executors=["inductor", "torch"], fuse="wait")
    with torch.no_grad():
        out = jitted(x)
        jitted(x)  # every region has made its first call
    return jitted, out


@needs_cxx
def test_a_restart_loads_each_region_from_the_store_without_compile_fx(own_store, monkeypatch):
    import keraunos
    from keraunos.executors.fusion import kernel_store
    model, reference, x = _gpt()
    jitted, _ = _fused_run(model, x)
    first = keraunos.last_fusions(jitted)
    keys = {f.kernel.store_key for f in first}
    assert None not in keys and len(keys) >= 2, [f.kernel for f in first]
    assert all(own_store.get(kernel_store.NAMESPACE, k) for k in keys)

    monkeypatch.setattr(compiler, "_kernels", {})  # the restart: nothing compiled in-process
    _no_compile_fx(monkeypatch)
    jitted, out = _fused_run(copy_of(reference), x)
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(jitted(x), reference(x), rtol=1e-4, atol=1e-4)
    again = keraunos.last_fusions(jitted)
    assert [f.kernel.cache for f in again] == [compiler.STORED] * len(first)
    assert {f.kernel.store_key for f in again} == keys


@needs_cxx
def test_a_stored_module_that_does_not_load_is_compiled_again(own_store, monkeypatch):
    import keraunos
    from keraunos.executors.fusion import kernel_store

    def f(x):
        return (torch.sin(x * 3).exp() + 2).tanh().mul(0.5).sub(x)

    x = torch.randn(7)
    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    jitted(x)
    jitted(x)
    [key] = {r.kernel.store_key for r in keraunos.last_fusions(jitted)}
    assert own_store.get(kernel_store.NAMESPACE, key) is not None
    own_store.put(kernel_store.NAMESPACE, key, b"this is not Inductor's module(")
    monkeypatch.setattr(compiler, "_kernels", {})
    jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
    torch.testing.assert_close(jitted(x), f(x))
    torch.testing.assert_close(jitted(x), f(x))
    [region] = keraunos.last_fusions(jitted)
    assert region.kernel.cache != compiler.STORED
    # the first call compiled it and kept the good module in place of the bad one
    assert b"def call(" in own_store.get(kernel_store.NAMESPACE, key)


@needs_cxx
def test_a_region_that_writes_its_input_is_stored_and_a_restart_counts_its_writes(own_store,
                                                                                 monkeypatch):
    """A region that writes its input (a KV cache, BatchNorm's statistics) is kept with the
    positions of what it writes; a restart loads it without ``compile_fx``, writes the input as
    eager does and counts the write in its version counter."""
    import keraunos
    from keraunos.executors.fusion import kernel_store

    def f(x, buffer):
        buffer.mul_(0.5).add_(x.exp().sin())
        return (x.cos() * 2 + 1).tanh()

    def run():
        x, buffer = torch.randn(6), torch.randn(6)
        expected_buffer = buffer.clone()
        expected = f(x, expected_buffer)
        jitted = keraunos.jit(f, executors=["inductor", "torch"], fuse="wait")
        torch.testing.assert_close(jitted(x, buffer), expected)
        torch.testing.assert_close(buffer, expected_buffer)
        version = buffer._version
        torch.testing.assert_close(jitted(x, buffer), f(x, expected_buffer))
        torch.testing.assert_close(buffer, expected_buffer)
        assert buffer._version > version  # the write is seen by autograd's checks
        return [r for r in keraunos.last_fusions(jitted) if r.written]

    writing = run()
    assert writing, "no region writes its input: nothing was tested"
    for r in writing:
        assert own_store.get(kernel_store.NAMESPACE, r.kernel.store_key or "") is not None
    monkeypatch.setattr(compiler, "_kernels", {})  # the restart: nothing compiled in-process
    _no_compile_fx(monkeypatch)
    again = run()
    assert [r.kernel.cache for r in again] == [compiler.STORED] * len(writing)


def test_symbolic_and_non_cpu_regions_have_no_store_key():
    import sympy
    from keraunos.executors.fusion import kernel_store
    cpu, meta = torch.device("cpu"), torch.device("meta")
    static = ((4, 8), (8, 1), torch.float32, cpu)
    env = (1, torch.float32, False, torch.__version__, "h", ())
    assert kernel_store.key_of(("src", (static,), (0,), env, None)) is not None
    assert kernel_store.key_of(("src", (static,), (0,), env, ("fact",))) is None
    s0 = sympy.Symbol("s0")
    assert kernel_store.key_of(("src", (((s0, 8), (8, 1), torch.float32, cpu),), (0,), env,
                                None)) is None
    assert kernel_store.key_of(("src", (("int", s0),), (0,), env, None)) is None
    assert kernel_store.key_of(("src", (((4, 8), (8, 1), torch.float32, meta),), (0,), env,
                                None)) is None
    # anything that decides the code changes the key
    assert kernel_store.key_of(("src", (static,), (0,), env, None)) != kernel_store.key_of(
        ("src2", (static,), (0,), env, None))
    assert kernel_store.key_of(("src", (static,), (0,), env, None)) != kernel_store.key_of(
        ("src", (static,), (0,), (2, *env[1:]), None))


RESTART = textwrap.dedent("""
    import copy, sys, torch, keraunos
    from keraunos.examples.gpt import GPT, GPTConfig
    from keraunos.executors.fusion import compiler, warming
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).eval()
    jitted = keraunos.jit(copy.deepcopy(model), executors=["inductor", "torch"], fuse="wait")
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        for _ in range(2):  # a region is kept in the store after its first call
            torch.testing.assert_close(jitted(x), model(x), rtol=1e-4, atol=1e-4)
    assert keraunos.compile_stats(jitted).tier == "fused", keraunos.compile_stats(jitted)
    print("kernels:", sorted({f.kernel.cache for f in keraunos.last_fusions(jitted)}))
    print("compiler imported:", [m for m in ("torch._inductor.compile_fx",
          "torch._inductor.select_algorithm", "torch._inductor.lowering") if m in sys.modules])
    print("ok")
""")


@needs_cxx
def test_a_restart_that_loads_every_region_imports_no_inductor_compiler(tmp_path):
    """Inductor's compiler (``compile_fx``, its lowering, ``select_algorithm``) costs a restart
    about 0.6 s to import. A process whose regions all come from keraunos's store imports none of
    it: the stored modules call ``torch.mm`` where Inductor's call ``extern_kernels.mm`` (the
    same object), and the hook that collects generated sources is installed by a compile only.
    A cold process, then a restart, each a real process on the same two cache directories."""
    script = tmp_path / "program.py"
    script.write_text(RESTART)
    import keraunos
    here = os.path.dirname(os.path.dirname(keraunos.__file__))  # this checkout's keraunos
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "KERAUNOS_CACHE_DIR": str(tmp_path / "store"), "KERAUNOS_FUSE": "",
           "PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))}
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
        outputs.append(done.stdout)
    cold, restart = outputs
    assert "kernels: ['compiled']" in cold and "'torch._inductor.compile_fx'" in cold, cold
    assert "kernels: ['keraunos store']" in restart, restart
    assert "compiler imported: []" in restart, restart


def test_a_stored_module_calls_torch_for_extern_kernels_that_are_torchs():
    from keraunos.executors.fusion import kernel_store
    header = "import torch\nfrom torch._inductor.select_algorithm import extern_kernels\n"
    uses_mm = header + "def call(a, b, out):\n    extern_kernels.mm(a, b, out=out)\n"
    rewritten = kernel_store._lighter_imports(uses_mm)
    assert "select_algorithm" not in rewritten
    scope = {}
    exec(rewritten, scope)
    a, b, out = torch.randn(3, 4), torch.randn(4, 5), torch.empty(3, 5)
    scope["call"](a, b, out)
    torch.testing.assert_close(out, torch.mm(a, b))


def test_a_stored_module_keeps_inductors_extern_kernels_where_one_is_not_torchs():
    from keraunos.executors.fusion import kernel_store
    header = "import torch\nfrom torch._inductor.select_algorithm import extern_kernels\n"
    own_kernel = header + "def call(a, b, c):\n    return extern_kernels.bias_addmm(a, b, c)\n"
    assert kernel_store._lighter_imports(own_kernel) == own_kernel
    missing = header + "def call(a):\n    return extern_kernels.no_such_kernel(a)\n"
    assert kernel_store._lighter_imports(missing) == missing
    whole = header + "def call(a):\n    return getattr(extern_kernels, 'mm')(a, a)\n"
    assert kernel_store._lighter_imports(whole) == whole


def test_a_stored_module_imports_memory_planning_only_when_it_aligns():
    from torch._inductor.codegen.memory_planning import _align
    from keraunos.executors.fusion import kernel_store
    module = ("import torch\nfrom torch._inductor.codegen.memory_planning import _align as align\n"
              "def call(n):\n    return align(n)\n")
    rewritten = kernel_store._lighter_imports(module)
    assert "memory_planning import _align as align" not in rewritten
    scope = {}
    exec(rewritten, scope)
    assert [scope["call"](n) for n in (1, 63, 64, 65, 1000)] == [_align(n) for n in (1, 63, 64, 65, 1000)]


class _Candidate:
    """A vector ISA whose test build is recorded: ``bool()`` is the build."""

    def __init__(self, name, builds, log):
        self.name, self.builds, self.log = name, builds, log

    def __bool__(self):
        self.log.append(self.name)
        return self.builds

    def __str__(self):
        return self.name


def test_the_candidate_list_builds_only_what_is_read():
    """Inductor test-builds every vector ISA the CPU claims (four g++ builds on an AMX machine)
    and uses the first that works: keraunos's list gives the same answers and builds a candidate
    only when a reader gets to it."""
    from keraunos.executors.fusion.isa_probe import CandidateList
    log = []
    names = [("amx", False), ("avx512_vnni", True), ("avx512", True), ("avx2", True)]
    candidates = CandidateList([_Candidate(n, ok, log) for n, ok in names])
    eager = [c for c in (_Candidate(n, ok, []) for n, ok in names) if c]
    assert bool(candidates) and str(candidates[0]) == str(eager[0]) == "avx512_vnni"
    assert log == ["amx", "avx512_vnni"], "more was built than the first valid candidate"
    assert str(candidates[0]) == "avx512_vnni" and len(log) == 2, "a build was not remembered"
    assert next(str(c) for c in candidates if str(c) == "avx512") == "avx512"
    assert log == ["amx", "avx512_vnni", "avx512"]
    assert [str(c) for c in candidates] == [str(c) for c in eager]
    assert len(candidates) == len(eager) == 3 and log == [n for n, _ in names]
    assert [str(c) for c in candidates[-2:]] == ["avx512", "avx2"]
    nothing = CandidateList([_Candidate("amx", False, log)])
    assert not nothing and list(nothing) == [] and len(nothing) == 0
    candidates.forget()
    assert str(candidates[0]) == "avx512_vnni" and log[-2:] == ["amx", "avx512_vnni"]


def test_inductor_picks_the_isa_it_would_pick_without_keraunos():
    """With keraunos's list in place, ``pick_vec_isa`` answers what Inductor's own list gives,
    with ``simdlen`` unset and set to each width; out of ``patches.applied()`` Inductor's own
    list is back."""
    from torch._inductor import config, cpu_vec_isa

    from keraunos.executors.fusion import patches
    own = cpu_vec_isa.valid_vec_isa_list
    with patches.applied():
        if cpu_vec_isa.valid_vec_isa_list is own:
            pytest.skip("not an x86 machine: Inductor's own list is used")
        expected = own()
        assert str(cpu_vec_isa.pick_vec_isa()) == str(expected[0] if expected
                                                      else cpu_vec_isa.invalid_vec_isa)
        for width in sorted({isa.bit_width() for isa in expected}):
            with config.patch({"cpp.simdlen": width}):
                assert str(cpu_vec_isa.pick_vec_isa()) == str(
                    next(isa for isa in expected if isa.bit_width() == width))
    assert cpu_vec_isa.valid_vec_isa_list is own
