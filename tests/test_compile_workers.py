"""Helper processes that compile a trace's regions ahead (``executors/fusion/workers.py``): a
region a helper compiled comes back as Inductor's generated module, which this process loads
(``compiler.STORED``) and checks on its first call as any region; one no helper compiled is
compiled here."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.persist import store
from keraunos.executors.fusion import compiler, workers
from keraunos.executors.fusion.compiler import toolchain_problem

pytestmark = pytest.mark.skipif(toolchain_problem("cpu") is not None,
                                reason="no working C++ compiler for Inductor's CPU kernels")

READY_S = 240  # a helper imports torch and Inductor: seconds, more on a loaded machine


def two_regions(x, w):
    """Two distinct regions, split by the random draw (regions never hold random ops)."""
    a = (x * 2 + 1).relu().sin() @ w
    return ((a + torch.rand_like(a)).tanh() * 3 - 1).sigmoid().cos()


def run_both(x, w):
    """The jitted and the eager result, each after the same seed."""
    jitted = keraunos.jit(two_regions, fuse="wait")
    torch.manual_seed(1)
    got = jitted(x, w)
    torch.manual_seed(1)
    assert_close(got, two_regions(x, w))
    return jitted


def ready_pool() -> workers.Pool:
    made = workers.Pool(1)
    made.start()
    deadline = time.monotonic() + READY_S
    while not made.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert made.idle, "the helper never said it was ready"
    return made


@pytest.fixture(scope="module")
def shared_pool(tmp_path_factory):
    """One helper for the module (it imports torch and Inductor: seconds), working in a cache
    directory of its own; each test uses inputs of its own sizes, so that no test finds another's
    regions in it."""
    directory = tmp_path_factory.mktemp("inductor")
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)  # the helper's, from its start
    try:
        made = ready_pool()
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    yield made, directory
    made.stop()


@pytest.fixture
def pool(shared_pool, tmp_path, monkeypatch):
    """The helper, ready; this process compiling in the same cache directory, with no kernel of
    its own yet and an empty store; the machine taken for idle whatever its load (the tests
    decide where regions compile, not the load average)."""
    made, directory = shared_pool
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory))  # a restarted helper's too
    # The tests decide where regions compile, so the helper is ready and idle when a test starts
    # and stays so: on a loaded machine a test module outlasts the idle time after which a helper
    # is ended (the next region would then find it still importing, and be compiled here), and a
    # job an earlier test left would hold it busy.
    monkeypatch.setattr(workers, "IDLE_S", 10 ** 6)
    made.start()
    deadline = time.monotonic() + READY_S
    while (not made.idle or len(made.idle) != len(made.helpers) or made.queue) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert made.idle and not made.queue, "the helper is not ready and idle"
    monkeypatch.setattr(store, "_default", store.Store(tmp_path / "store"))
    monkeypatch.setattr(workers, "busy", lambda: False)
    monkeypatch.setattr(compiler, "_kernels", {})
    monkeypatch.setattr(workers, "_pool", made)
    yield made


def inputs(rows: int):
    torch.manual_seed(0)
    return torch.randn(rows, 8), torch.randn(8, 8)


def test_a_region_a_helper_compiled_is_a_cache_hit_here(pool):
    x, w = inputs(4)
    jitted = run_both(x, w)
    kernels = [r.kernel for r in keraunos.last_fusions(jitted)]
    assert len({k.number for k in kernels}) == 2
    # this thread compiled the first region; the helper the second, whose generated module this
    # process loaded
    assert kernels[0].cache == "compiled"
    assert kernels[1].cache == compiler.STORED, kernels[1].cache
    assert not pool.jobs and not pool.queue


def test_a_helper_that_dies_leaves_its_region_to_this_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(store, "_default", store.Store(tmp_path / "store"))
    monkeypatch.setattr(workers, "busy", lambda: False)
    monkeypatch.setattr(compiler, "_kernels", {})
    pool = ready_pool()  # its own: this test kills it
    monkeypatch.setattr(workers, "_pool", pool)
    helper = pool.helpers[0]
    sent = helper.send

    def send_and_die(job):
        done = sent(job)
        helper.process.kill()  # mid-compile
        return done
    monkeypatch.setattr(helper, "send", send_and_die)
    x, w = inputs(5)
    jitted = run_both(x, w)
    kernels = [r.kernel for r in keraunos.last_fusions(jitted)]
    assert [k.cache for k in kernels] == ["compiled", "compiled"]
    assert not pool.helpers  # the lost helper is dropped
    pool.stop()


def test_a_region_no_helper_started_is_compiled_here(pool, monkeypatch):
    monkeypatch.setattr(pool, "idle", [])  # the helper is busy elsewhere: the job waits
    x, w = inputs(6)
    jitted = run_both(x, w)
    assert [r.kernel.cache for r in keraunos.last_fusions(jitted)] == ["compiled", "compiled"]
    assert not pool.queue and not pool.jobs  # taken back, not left for the helper


def test_a_process_with_helpers_exits_at_once_and_takes_them_along(tmp_path):
    script = tmp_path / "helpers.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch, keraunos
        from keraunos.executors.fusion import workers
        workers.busy = lambda: False
        workers._the_pool().start()  # still importing torch when the process leaves: killed
        print("helpers", *[h.process.pid for h in workers._pool.helpers], flush=True)
        def f(x, w):
            a = (x * 2 + 1).relu().sin() @ w
            return ((a + torch.rand_like(a)).tanh() * 3 - 1).sigmoid().cos()
        keraunos.jit(f)(torch.randn(4, 8), torch.randn(8, 8))  # fused in the background
        print("leaving", time.time(), flush=True)
    """))
    env = {**os.environ, "KERAUNOS_COMPILE_WORKERS": "1", "KERAUNOS_FUSE": "background",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out_path = tmp_path / "stdout"
    with open(out_path, "w") as out:
        done = subprocess.run([sys.executable, str(script)], stdout=out,
                              stderr=subprocess.PIPE, env=env, timeout=READY_S + 60)
    ended = time.time()
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    text = out_path.read_text()
    pids = [int(p) for p in text.split("helpers")[1].split("\n")[0].split()]
    assert len(pids) == 1
    assert ended - float(text.split("leaving")[1]) < 15.0  # (as in test_tiers.py)
    for pid in pids:  # killed (a zombie until reaped) or gone
        try:
            state = open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            continue
        assert "State:\tZ" in state, state[:200]


def test_the_backwards_regions_go_to_helpers_while_the_forward_compiles(pool):
    x, w = inputs(7)
    x.requires_grad_(True)
    w.requires_grad_(True)
    jitted = keraunos.jit(two_regions, fuse="wait")
    torch.manual_seed(1)
    jitted(x, w).sum().backward()
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    torch.manual_seed(1)
    two_regions(x, w).sum().backward()
    assert_close(got, (x.grad, w.grad))
    fusions = keraunos.last_fusions(jitted)
    backward = [r.kernel.cache for r in fusions if r.trace_name == "backward" and not r.shared_with]
    # the helper, idle, took the backward's last region as soon as it was handed over (before
    # the forward's compile began): this process loaded its module
    assert backward and backward[-1] == compiler.STORED, backward
    assert not pool.jobs and not pool.queue


def test_helpers_idle_for_a_while_are_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    pool = ready_pool()
    helper = pool.helpers[0]
    monkeypatch.setattr(workers, "IDLE_S", 0.0)
    pool._end_if_idle()
    assert not pool.helpers and not pool.idle
    assert helper.process.wait(timeout=60) == 0  # it read the end of its input and left
    pool.stop()


def test_the_helper_compiles_under_this_processs_settings(pool):
    """What Inductor's cache keys on besides the graph goes with the job: here a matmul
    precision set and set back, which leaves torch's per-backend setting at "ieee" where a fresh
    process has "none" (a key the helper's compile would not have shared)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        x, w = inputs(9)
        jitted = run_both(x, w)
        kernels = [r.kernel.cache for r in keraunos.last_fusions(jitted)]
        assert kernels[1] == compiler.STORED, kernels
    finally:
        torch.set_float32_matmul_precision(before)


SPAWNED = '''
import sys
import torch
import torch.multiprocessing as mp


def child(rank, queue):
    import io
    from keraunos.executors.fusion import workers
    out = io.BytesIO()
    workers._GraphPickler(out).dump([torch.contiguous_format, torch.channels_last,
                                     torch.float16, torch.strided])
    queue.put(out.getvalue())


if __name__ == "__main__":
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(child, args=(queue,), nprocs=1)
    sys.stdout.write(queue.get().hex())
'''


def test_a_graph_pickled_in_a_spawned_process_names_torchs_constants_by_torch(tmp_path):
    """In a process ``multiprocessing`` spawned, pickle's own lookup names ``torch.float16`` and
    the memory formats as attributes of ``__mp_main__``, which a helper process cannot find: the
    graph pickler names them in ``torch`` itself."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = bytes.fromhex(done.stdout.strip())
    assert b"__mp_main__" not in data and b"__main__" not in data
    assert pickle.loads(data) == [torch.contiguous_format, torch.channels_last, torch.float16,
                                  torch.strided]


CONFIG_CHANGES = '''
import sys
import torch, keraunos
from keraunos.executors.fusion import compiler
import torch._inductor.config as config
assert compiler.inductor_config_changes() == {}, compiler.inductor_config_changes()
print("lowering imported:", "torch._inductor.lowering" in sys.modules)
with config.patch(max_fusion_size=17):
    print("patched:", compiler.inductor_config_changes())
config.max_fusion_size = 23
print("set:", compiler.inductor_config_changes())
'''


def test_the_inductor_settings_a_helper_gets_are_those_this_process_changed(tmp_path):
    """A helper process applies the Inductor config entries its parent changed (within
    ``config.patch`` too), read on the calling thread without serializing the whole config (from
    torch 2.15 that imports Inductor's lowering, a second of a restart)."""
    script = tmp_path / "changes.py"
    script.write_text(CONFIG_CHANGES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["lowering imported: False",
                                        "patched: {'max_fusion_size': 17}",
                                        "set: {'max_fusion_size': 23}"], done.stdout
