"""The native hit path (``keraunos/runtime/native``): a jitted function's hit in one C call. It must accept
a call exactly when the Python hit path accepts it, and give eager's results; anything it
rejects goes to the Python path, which explains the miss and recompiles as before. Every
behaviour is compared with eager PyTorch."""
import contextlib
import logging
import os
import threading

import pytest
import torch
from torch.testing import assert_close

import keraunos
import keraunos.runtime.jitted
from keraunos.runtime import native
from keraunos.capture.ambient import AMBIENT_STATE
from keraunos.runtime.call import state_of


@pytest.fixture(scope="module", autouse=True)
def _native_loaded():
    """These tests need the extension: built here if this machine has not built it yet."""
    if native.LOADER.start(wait=True) is None:
        pytest.fail(f"the native hit path could not be built: {native.LOADER.failed}")


@pytest.fixture(autouse=True, params=["front", "checked"])
def _call_route(request, monkeypatch):
    """Each test twice: with the Front as the class's ``__call__`` (how users call it) and with
    the suite's result checks, a Python ``__call__`` that calls the Front."""
    monkeypatch.setattr(keraunos.runtime.jitted, "CHECK_RESULTS", request.param == "checked")


def _f(x):
    return (x * 2 + 1).relu()


def _jit(fn=_f, *args):
    jitted = keraunos.jit(fn)
    args = args or (torch.randn(4),)
    jitted(*args)
    return jitted


def _hit(jitted):
    state = state_of(jitted)
    assert state.native_front is not None, "the jitted function was not given the native path"
    return state.native_front.hit


def _python_accepts(jitted, *args, **kwargs) -> bool:
    entry = state_of(jitted).entries[0]
    try:
        r = entry.prologue_fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - "not this entry", as for the hit path
        return False
    return type(r) is tuple


def _counted_python_hit_path(jitted) -> list:
    """Count the calls the front entry's Python hit path gets from now on."""
    entry, calls = state_of(jitted).entries[0], []
    python_hit = entry.hit_fn

    def counted(args, kwargs):
        calls.append(1)
        return python_hit(args, kwargs)
    entry.hit_fn = counted
    return calls


def test_native_path_serves_a_tiny_function_with_eager_results():
    jitted = _jit()
    hit = _hit(jitted)
    assert hit is not None, native.why_not(state_of(jitted).entries[0])
    python_calls = _counted_python_hit_path(jitted)
    for _ in range(3):
        x = torch.randn(4)
        assert_close(jitted(x), _f(x))
    assert python_calls == []  # served in C
    assert (type(jitted).__call__ is state_of(jitted).native_front) == (
        not keraunos.runtime.jitted.CHECK_RESULTS)
    assert hit.armed  # the guards' values recorded: later calls skip the guards
    assert (keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)) == (1, 3)
    assert state_of(jitted).last_entry is state_of(jitted).entries[0]


def test_native_path_with_autograd_gives_eager_gradients():
    def f(x, w):
        return (x @ w).tanh().sum()

    x, w = torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)
    jitted = _jit(f, x, w)
    assert _hit(jitted) is not None
    w2 = w.detach().clone().requires_grad_()
    jitted(x, w).backward()
    f(x, w2).backward()
    assert_close(w.grad, w2.grad)


# Each setting the prologue compares: changed, the native path must reject what the Python path
# rejects, and the call must miss, recompile and explain itself as it does without it.
def _precision_per_backend():
    previous = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous


@contextlib.contextmanager
def _changed(setter, getter, value):
    # Setting a matmul precision or TF32 back also turns the CUDA matmul precision from "none"
    # into "ieee", which dynamo's global state compares from torch 2.15: it is put back too.
    before, cuda_before = getter(), torch.backends.cuda.matmul.fp32_precision
    setter(value)
    try:
        yield
    finally:
        setter(before)
        torch.backends.cuda.matmul.fp32_precision = cuda_before


_cuda_matmul = torch.backends.cuda.matmul
SETTINGS = {
    "grad mode": lambda: torch.no_grad(),
    "inference mode": lambda: torch.inference_mode(),
    "default dtype": lambda: _changed(torch.set_default_dtype, torch.get_default_dtype,
                                      torch.float64),
    "autocast on cpu": lambda: torch.autocast("cpu"),
    "autocast dtype on cpu": lambda: _changed(
        lambda d: torch.set_autocast_dtype("cpu", d), lambda: torch.get_autocast_dtype("cpu"),
        torch.float16),
    "autocast's cast cache": lambda: _changed(torch.set_autocast_cache_enabled,
                                              torch.is_autocast_cache_enabled, False),
    "deterministic algorithms": lambda: _changed(torch.use_deterministic_algorithms,
                                                 torch.are_deterministic_algorithms_enabled,
                                                 True),
    "deterministic algorithms, warn only": lambda: _changed(
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        lambda: (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled()), (True, True)),
    "float32 matmul precision": lambda: _changed(torch.set_float32_matmul_precision,
                                                 torch.get_float32_matmul_precision, "high"),
    "float32 matmul precision per backend": lambda: contextlib.contextmanager(
        _precision_per_backend)(),
    "TF32 matmuls (cuBLAS)": lambda: _changed(lambda v: setattr(_cuda_matmul, "allow_tf32", v),
                                              lambda: _cuda_matmul.allow_tf32, True),
    "float16 reduced-precision reductions (cuBLAS)": lambda: _changed(
        lambda v: setattr(_cuda_matmul, "allow_fp16_reduced_precision_reduction", v),
        lambda: _cuda_matmul.allow_fp16_reduced_precision_reduction, False),
    "bfloat16 reduced-precision reductions (cuBLAS)": lambda: _changed(
        lambda v: setattr(_cuda_matmul, "allow_bf16_reduced_precision_reduction", v),
        lambda: _cuda_matmul.allow_bf16_reduced_precision_reduction, False),
    "intra-op threads": lambda: _changed(torch.set_num_threads, torch.get_num_threads,
                                         torch.get_num_threads() + 1),
}


class _Affine(torch.nn.Module):
    """``(x @ w + 1).relu()`` with ``w`` a parameter: a module entry (its kept module walk)."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone(), requires_grad=False)
        self.act = torch.nn.ReLU()  # its ``inplace`` is checked by identity on every call

    def forward(self, x):
        return self.act(x @ self.w + 1)


def _program(kind: str):
    """``(jitted, args, eager)`` of one kind of entry the native path serves: a function's static
    entry, a module's, a function's symbolic entry (every size a symbol)."""
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    if kind == "module":
        eager = _Affine(w)
        jitted = keraunos.jit(eager)
        args = (x,)
    else:
        def eager(x, w):
            return (x @ w + 1).relu()
        jitted = keraunos.jit(eager, dynamic=kind == "symbolic")
        args = (x, w)
    jitted(*args)
    return jitted, args, eager


KINDS = ["function", "module", "symbolic"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_setting_change_falls_back_to_the_python_path_and_recompiles(setting, kind):
    jitted, args, f = _program(kind)
    hit = _hit(jitted)
    assert hit is not None, native.why_not(state_of(jitted).entries[0])
    assert hit.accepts(*args) is True and hit.armed  # the recorded values must not let it pass
    with SETTINGS[setting]():
        assert hit.accepts(*args) is False
        assert _python_accepts(jitted, *args) is False
        assert_close(jitted(*args), f(*args))
        assert keraunos.cache_misses(jitted) == 2
        reasons = " ".join(state_of(jitted).last_miss_reasons)
        if setting.endswith("per backend"):  # torch's getter raises: the prologue cannot run
            assert "could not unpack" in reasons and "matmul precision" in reasons
        else:  # the miss names the setting, as on the Python path
            assert f"{setting} is " in reasons and reasons.startswith("check failed"), reasons
        # The new entry is served natively in the new setting, and again gives eager's values.
        python_calls = _counted_python_hit_path(jitted)
        assert_close(jitted(*args), f(*args))
        new_hit = _hit(jitted)
        if new_hit is not None:
            assert python_calls == []
    # Back as compiled (a module's first call after compiling walks its tree again in Python:
    # capture registered modules, which changes the module-structure token).
    assert_close(jitted(*args), f(*args))
    assert hit.accepts(*args) is True
    assert_close(jitted(*args), f(*args))
    assert keraunos.cache_misses(jitted) == 2  # the first entry again, no compilation


def test_every_ambient_setting_is_checked_by_the_native_path_or_keeps_python():
    """A new kind of ambient state (capture/ambient.py) must be compared by dynamo's
    GlobalStateGuard, implied by the tensor checks, or read by the native hit itself: otherwise
    the native path would accept calls the prologue rejects."""
    for ambient in AMBIENT_STATE:
        assert (ambient.in_global_state_guard or ambient.implied_by_tensor_checks
                or ambient.native is not None
                or ambient.label == "TF32 convolutions (cuDNN)"), ambient.label


TENSOR_CHANGES = {
    "shape": lambda x: torch.randn(5, 4),
    "stride": lambda x: torch.randn(4, 4).t(),
    "dtype": lambda x: x.double(),
    "requires_grad": lambda x: x.clone().requires_grad_(),
    "a tensor subclass": lambda x: torch.nn.Parameter(x.clone(), requires_grad=False),
    "an inference tensor": lambda x: _inference_copy(x),
}


def _inference_copy(x):
    with torch.inference_mode():
        return x.clone()


@pytest.mark.parametrize("change", list(TENSOR_CHANGES))
def test_each_tensor_change_falls_back_to_the_python_path(change):
    x = torch.randn(4, 4)
    jitted = _jit(_f, x)
    hit = _hit(jitted)
    assert hit is not None
    assert hit.accepts(x) is True and hit.armed
    other = TENSOR_CHANGES[change](x)
    assert hit.accepts(other) is False
    assert _python_accepts(jitted, other) is False
    expected = _f(other)
    assert_close(jitted(other), expected)
    assert type(jitted(other)) is type(expected)
    assert keraunos.cache_misses(jitted) == 2
    assert hit.accepts(x) is True
    assert_close(jitted(x), _f(x))


def test_entry_compiled_under_autocast_is_served_by_the_guards_alone():
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    with torch.autocast("cpu"):
        jitted = _jit(lambda x, w: x @ w, x, w)
        hit = _hit(jitted)
        assert hit is not None
        python_calls = _counted_python_hit_path(jitted)
        assert_close(jitted(x, w), x @ w)
        assert python_calls == [] and not hit.armed  # autocast on: nothing recorded
    assert_close(jitted(x, w), x @ w)
    assert keraunos.cache_misses(jitted) == 2


def test_argument_count_and_keywords_take_the_python_path():
    def f(x, y=None):
        return x * 2 if y is None else x * y

    x = torch.randn(3)
    jitted = _jit(f, x)
    hit = _hit(jitted)
    assert hit is not None
    assert hit.accepts(x, x) is False
    assert hit.accepts(3.0) is False and hit.accepts(x.tolist()) is False
    assert_close(jitted(x, x), f(x, x))
    assert_close(jitted(x, y=x), f(x, y=x))  # keywords: never the native path
    assert keraunos.cache_misses(jitted) == 3
    assert_close(jitted(x), f(x))


def test_entries_the_native_path_cannot_express_keep_the_python_hit_path():
    x = torch.randn(3)
    cases = {
        "a Python number": (lambda x, n: x * n, (x, 2)),
        "the same tensor twice": (lambda x, y: x + y, (x, x)),
        "a written input": (lambda x: x.add_(1), (x.clone(),)),
        "a list of tensors": (lambda xs: xs[0] + xs[1], ([x, x + 1],)),
        "a result built by the epilogue": (lambda x: (x, x + 1), (x,)),
        "an input returned as it is": (lambda x, y: x, (x, x + 1)),
    }
    for name, (fn, args) in cases.items():
        jitted = keraunos.jit(fn)
        jitted(*args)
        assert state_of(jitted).native_front.hit is None, name
        assert_close(jitted(*args), fn(*args))
    buffers = torch.nn.BatchNorm1d(3)  # writes its running statistics: the epilogue's work
    module = keraunos.jit(buffers)
    batch = torch.randn(4, 3)
    module(batch)
    assert _hit(module) is None
    reference = torch.nn.BatchNorm1d(3)
    reference(batch)
    assert_close(module(batch), reference(batch))
    assert_close(buffers.running_mean, reference.running_mean)


@pytest.mark.parametrize("grad", [False, True])
def test_module_entry_is_served_natively_with_eager_results(grad):
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    jitted = keraunos.jit(eager)
    x = torch.randn(2, 8)
    with torch.set_grad_enabled(grad):
        jitted(x)
        hit = _hit(jitted)
        assert hit is not None, native.why_not(state_of(jitted).entries[0])
        python_calls = _counted_python_hit_path(jitted)
        for _ in range(3):
            x = torch.randn(2, 8)
            assert_close(jitted(x), eager(x))
        assert python_calls == [] and hit.armed  # served in C
        assert type(jitted).__qualname__ == "JittedModule[Sequential]"
        assert isinstance(jitted, keraunos.runtime.jitted.JittedModule)
    assert (keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)) == (1, 3)
    if grad:
        copy = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 8))
        copy.load_state_dict(eager.state_dict())
        jitted(x).sum().backward()
        copy(x).sum().backward()
        assert_close(eager[0].weight.grad, copy[0].weight.grad)


MODULE_CHANGES = {
    "a parameter's data of another shape": lambda m: setattr(
        m.w, "data", torch.randn(3, 5)),
    "a parameter replaced": lambda m: setattr(m, "w", torch.nn.Parameter(
        torch.randn(3, 4), requires_grad=False)),
    "a submodule added": lambda m: setattr(m, "extra", torch.nn.Linear(2, 2)),
    "an attribute the program reads": lambda m: setattr(m.act, "inplace", True),
    "requires_grad of a parameter": lambda m: m.w.requires_grad_(),
    "a forward hook on a submodule": lambda m: m.act.register_forward_hook(
        lambda mod, i, o: o * 2),
}


@pytest.mark.parametrize("change", list(MODULE_CHANGES))
def test_each_module_change_falls_back_to_the_python_path(change):
    jitted, (x,), eager = _program("module")
    hit = _hit(jitted)
    assert hit is not None and hit.accepts(x) is True and hit.armed
    MODULE_CHANGES[change](eager)
    assert hit.accepts(x) is False
    assert_close(jitted(x), eager(x))
    assert keraunos.cache_misses(jitted) == 2
    assert state_of(jitted).last_miss_reasons


def test_symbolic_entry_is_served_natively_for_each_size():
    jitted, (x, w), f = _program("symbolic")
    hit = _hit(jitted)
    assert hit is not None, native.why_not(state_of(jitted).entries[0])
    python_calls = _counted_python_hit_path(jitted)
    for n in (5, 6, 2, 5, 5):
        x = torch.randn(n, 3)
        assert_close(jitted(x, w), f(x, w))
    assert python_calls == [] and hit.armed  # each size decided in C (or by its prologue)
    assert keraunos.cache_misses(jitted) == 1
    one = torch.randn(1, 3)  # outside the symbol's range (sizes 0 and 1 are specialized)
    assert hit.accepts(one, w) is False and _python_accepts(jitted, one, w) is False
    assert_close(jitted(one, w), f(one, w))
    assert keraunos.cache_misses(jitted) == 2
    assert any("s0" in r or "shape" in r for r in state_of(jitted).last_miss_reasons)


def test_threads_each_with_their_grad_mode_and_thread_count():
    def f(x):
        return (x.sin() * 3).sum(0)

    jitted = _jit(f, torch.randn(8, 4))
    errors = []

    def work(no_grad: bool):
        try:
            x = torch.randn(8, 4, requires_grad=True)
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                for _ in range(50):
                    out = jitted(x)
                    assert_close(out, f(x))
                    assert out.requires_grad is not no_grad
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)
    try:
        x = torch.randn(8, 4)
        misses = keraunos.cache_misses(jitted)
        assert_close(jitted(x), f(x))
        assert keraunos.cache_misses(jitted) == misses + 1
        assert "intra-op threads" in " ".join(state_of(jitted).last_miss_reasons)
    finally:
        torch.set_num_threads(before)


def test_tier_switch_is_seen_by_the_native_path():
    jitted = _jit()
    assert _hit(jitted) is not None
    entry, ran = state_of(jitted).entries[0], []
    computation = entry.computation_fn

    def switched(*inputs):
        ran.append(1)
        return computation(*inputs)
    entry.computation_fn = switched  # what tiers._switch does
    x = torch.randn(4)
    assert_close(jitted(x), _f(x))
    assert ran == [1]


# ----------------------------------------------------------------- the program's own errors
def _raising_after_the_checks_change(entry, calls: list):
    """The entry's computation, replaced: it counts its runs, changes what the prologue checks
    (grad mode) and raises, as a program that writes and then fails may leave things."""
    def computation(*inputs):
        calls.append(1)
        torch.set_grad_enabled(False)
        raise ValueError("the program's own error")
    entry.computation_fn = computation


@pytest.mark.parametrize("path", ["native", "python"])
def test_program_error_is_raised_once_and_never_retried(path):
    def f(x, y=None):
        return x * 2

    x = torch.randn(3)
    jitted = keraunos.jit(f)
    call = (lambda: jitted(x)) if path == "native" else (lambda: jitted(x, y=None))
    call()
    if path == "native":
        assert _hit(jitted) is not None
    calls = []
    _raising_after_the_checks_change(state_of(jitted).entries[0], calls)
    with pytest.raises(ValueError, match="the program's own error"):
        call()
    torch.set_grad_enabled(True)
    assert calls == [1]
    assert keraunos.cache_misses(jitted) == 1  # not recompiled and run again


def test_program_error_on_the_python_hit_path_of_a_module_is_not_retried():
    module = torch.nn.Linear(3, 2)
    jitted = keraunos.jit(module)
    x = torch.randn(4, 3)
    jitted(x)
    calls = []
    _raising_after_the_checks_change(state_of(jitted).entries[0], calls)
    with pytest.raises(ValueError, match="the program's own error"):
        jitted(x)
    torch.set_grad_enabled(True)
    assert calls == [1]
    assert keraunos.cache_misses(jitted) == 1


# ------------------------------------------------------------------------------- the build
def test_build_goes_to_a_directory_keyed_by_source_and_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAUNOS_NATIVE_DIR", str(tmp_path))
    path = native.library_path()
    assert path.parent == tmp_path and torch.__version__ not in path.name
    assert native.build() == path and path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    module = native._import(path)
    assert hasattr(module, "Hit") and hasattr(module, "Front")


def test_a_failed_build_logs_once_and_leaves_the_python_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KERAUNOS_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    loader = native._Loader()
    monkeypatch.setattr(native, "LOADER", loader)
    with caplog.at_level(logging.DEBUG, logger="keraunos"):
        assert loader.start(wait=True) is None
    assert "failed" in loader.failed
    assert [r for r in caplog.records if "native hit path" in r.getMessage()] != []
    assert loader.start() is None  # not built again
    jitted = _jit()
    assert state_of(jitted).native_front is None
    x = torch.randn(4)
    assert_close(jitted(x), _f(x))
    # Nothing half-written; the failure is remembered, so the next process does not compile.
    assert [p.suffix for p in tmp_path.iterdir()] == [".failed"]
    fresh = native._Loader()
    assert fresh.start(wait=True) is None and "less than a day ago" in fresh.failed
    assert fresh.job is None


def test_functions_jitted_before_the_build_finished_go_native_after_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAUNOS_NATIVE_DIR", str(tmp_path))
    loader = native._Loader()
    monkeypatch.setattr(native, "LOADER", loader)
    gate = threading.Event()
    real_build = native.build

    def slow_build():
        gate.wait(60)
        return real_build()
    monkeypatch.setattr(native, "build", slow_build)
    jitted = _jit()
    assert state_of(jitted).native_front is None  # building: the Python path serves calls
    module, (m_x,), eager = _program("module")
    # A wrapper whose calls go another way (keraunos.jit of a DDP model routes each call
    # through DDP's forward): it must keep its Python call once the module loads.
    routed = keraunos.jit(torch.nn.Linear(3, 3))
    routed_calls = []

    def through_wrapper(state, args, kwargs):
        routed_calls.append(1)
        return keraunos.runtime.jitted.call(state, args, kwargs)
    object.__setattr__(routed, "_call", through_wrapper)
    x = torch.randn(4)
    assert_close(jitted(x), _f(x))
    gate.set()
    assert loader.job.done.wait(120)
    assert loader.module is None  # built in the background, imported on a user's thread:
    loader.poll()  # the next miss polls
    assert loader.module is not None, loader.failed
    assert _hit(jitted) is not None
    python_calls = _counted_python_hit_path(jitted)
    assert_close(jitted(x), _f(x))
    assert python_calls == []
    assert _hit(module) is not None  # a module jitted before the build, native after it
    assert_close(module(m_x), eager(m_x))
    assert state_of(routed).native_front is None
    for _ in range(2):
        assert_close(routed(m_x), routed._orig_mod(m_x))
    assert len(routed_calls) == 2


def test_native_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KERAUNOS_NATIVE", "0")
    loader = native._Loader()
    monkeypatch.setattr(native, "LOADER", loader)
    jitted = _jit()
    assert state_of(jitted).native_front is None and loader.failed == "KERAUNOS_NATIVE=0"
    assert os.environ["KERAUNOS_NATIVE"] == "0"


def test_module_attribute_checked_on_every_native_call():
    """Dropout reads ``training``: checked by identity in the module's ``__dict__`` in C, so
    ``eval()`` is a miss at once; in train mode its random mask follows ``manual_seed``."""
    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    jitted = keraunos.jit(eager)
    x = torch.randn(8, 4)
    with torch.no_grad():
        jitted(x)
        hit = _hit(jitted)
        assert hit is not None, native.why_not(state_of(jitted).entries[0])
        python_calls = _counted_python_hit_path(jitted)
        for seed in (1, 2):
            torch.manual_seed(seed)
            expected = eager(x)
            torch.manual_seed(seed)
            assert_close(jitted(x), expected)
        assert python_calls == [] and hit.armed
        jitted.eval()
        assert hit.accepts(x) is False
        assert_close(jitted(x), eager(x))
        assert keraunos.cache_misses(jitted) == 2
        assert any("training" in r for r in state_of(jitted).last_miss_reasons)


def test_a_hook_on_the_jitted_module_runs_after_it_went_native():
    jitted, (x,), eager = _program("module")
    assert _hit(jitted) is not None
    seen = []
    jitted.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert_close(jitted(x), eager(x))
    assert seen == [eager(x).shape]  # nn.Module.__call__ runs it around the compiled program


@pytest.mark.parametrize("kind", ["function", "module"])
def test_a_jitted_object_keeps_its_class_for_life(kind):
    # Going native and registering hooks change the ``__call__`` of the object's own class,
    # never the object's class: a reference to its class (a library's isinstance cache, a
    # subclass made from it) stays right.
    jitted, args, eager = _program(kind)
    cls = type(jitted)
    assert _hit(jitted) is not None and "__call__" in cls.__dict__
    if kind == "module":
        assert type(keraunos.jit(torch.nn.Linear(2, 2))) is not cls  # each object its own
        seen = []
        jitted.register_forward_pre_hook(lambda module, a: seen.append(1))
        assert cls.__call__ is torch.nn.Module.__call__ and state_of(jitted).native_front is None
        assert_close(jitted(*args), eager(*args))
        assert seen == [1]
    else:
        assert_close(jitted(*args), eager(*args))
    assert type(jitted) is cls


def test_symbolic_module_entry_is_served_natively_for_each_size():
    eager = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh())
    jitted = keraunos.jit(eager, dynamic=True)
    jitted(torch.randn(4, 3))
    hit = _hit(jitted)
    assert hit is not None, native.why_not(state_of(jitted).entries[0])
    python_calls = _counted_python_hit_path(jitted)
    for n in (2, 7, 7, 3, 2):
        x = torch.randn(n, 3)
        assert_close(jitted(x), eager(x))
    assert python_calls == [] and hit.armed
    assert keraunos.cache_misses(jitted) == 1
