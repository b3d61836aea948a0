"""Compiling in the background leaves the user's process alone.

keraunos compiles the fused tier of a jitted program in the background while the user's thread
goes on. Nothing the user's thread can see may change meanwhile: torch's functions and classes,
the warnings filters, Dynamo's and Inductor's configs, grad mode and autocast, torch.fx's
"tracing" flag; torch's own compilers called on the user's thread (``torch.compile``,
``torch.fx.symbolic_trace``, ``torch.export``) work as they do without keraunos; and a jitted
object the user drops is freed, compiling or not. Every test compares with eager PyTorch or with
the state before; the race tests check their premise (the fused compile was still under way)
and loop a few times.

- ``import keraunos`` replaces no function or class of torch (compared in a fresh process);
- every model of the zoo (``keraunos.testing.zoo``) through ``torch.compile(backend="keraunos")``,
  one after another in one process with the defaults (fused in the background), equals eager;
- ``torch.compile`` (Inductor and eager backends), ``torch.fx.symbolic_trace`` and
  ``torch.export.export`` on the user's thread during a fused compile give eager's results;
- the process state seen from the user's thread (``keraunos.testing.fuzz.process_state``) is
  the same before, during and after a fused compile while the thread enters and leaves
  ``warnings.catch_warnings()`` with ``simplefilter("error")``, and the fused compile succeeds;
- a jitted module or function deleted while its fused tier compiles is freed.
"""
import gc
import itertools
import json
import os
import random
import subprocess
import sys
import time
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import keraunos
from keraunos.runtime.call import state_of
from keraunos.executors.fusion.compiler import toolchain_problem
from keraunos.testing.fuzz import process_state
from keraunos.torch_internals import fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's keraunos
WAIT_S = 300  # a cold fused compile on a loaded 2-core machine: generous, never reached when healthy
TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # Inductor's kernels round differently from eager's

needs_cxx = pytest.mark.skipif(toolchain_problem("cpu") is not None,
                               reason="Inductor cannot build CPU kernels here (no C++ compiler)")


def _env(**changes) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _python(script: str, *args: str, timeout: float = 300, **env) -> str:
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


# ------------------------------------------------------------- a fused compile of seconds


class Block(nn.Module):
    """A layer with enough pointwise work to be fused; ``salt`` is a constant of its program, so
    that each model's kernels are new to Inductor's caches and the fused compile takes seconds."""

    def __init__(self, i: int, w_in: int, w_out: int, salt: float):
        super().__init__()
        self.i, self.salt = i, salt
        self.fc, self.norm = nn.Linear(w_in, w_out), nn.LayerNorm(w_out)

    def forward(self, x):
        h = self.norm(self.fc(x))
        kind = self.i % 4
        if kind == 0:
            h = F.gelu(h) * torch.sigmoid(h) + 0.5 * h
        elif kind == 1:
            h = torch.tanh(h).exp() - h.abs().sqrt()
        elif kind == 2:
            h = F.silu(h) + torch.cos(h) * 0.25
        else:
            h = torch.relu(h) ** 2 + torch.erf(h)
        return h.clamp(-4.0, 4.0) * (1.0 + 0.01 * self.i + self.salt)


def _slow_model(blocks: int = 6):
    """A model whose fused tier takes several seconds to compile (distinct layer widths: no
    kernel is shared between layers), and an identical eager copy."""
    salt = random.random()
    widths = [16 + 4 * (i % 5) for i in range(blocks + 1)]

    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[Block(i, widths[i], widths[i + 1], salt) for i in range(blocks)])
    return make(), make()


def _compiling(jitted) -> bool:
    return bool(keraunos.compile_stats(jitted).fusion_pending)


def _fusion_problem(jitted) -> str | None:
    """Why the fused tier of ``jitted`` failed to compile, or None."""
    note = keraunos.compile_stats(jitted).fusion_note or ""
    return note if "the fused compile failed" in note else None


def _start_slow_compile(blocks: int = 6):
    """A jitted slow model after its first call (which ran on the torch tier and equals eager),
    its eager twin and an input; its fused tier is compiling in the background."""
    model, twin = _slow_model(blocks)
    jitted = keraunos.jit(model, fuse="background")
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert_close(jitted(x), twin(x), **TOLERANCE)
    return jitted, twin, x


def _drain() -> None:
    """Wait for the fused compiles queued so far: one more, small, queued after them."""
    def f(x):
        return ((x.sin() * 2 + 1).tanh().exp() - x.cos()).relu().sqrt() + x.abs() * 3
    jitted = keraunos.jit(f, fuse="background")
    jitted(torch.randn(4, 4))
    keraunos.wait_for_fusion(jitted, WAIT_S)


@pytest.fixture
def quiet_background():
    """Each test starts with no fused compile under way, and leaves none behind; what a race
    left changed in the process (a warnings filter, torch.fx's tracing flag, ...) is put back
    afterwards, so that it fails one test, not the next ones too."""
    _drain()
    before = process_state.snapshot()
    yield
    _drain()
    process_state.restore(before, flags=True)


def _check_premise(jitted) -> None:
    """The fused tier is still compiling after the first call (what a race test needs)."""
    if not _compiling(jitted):
        pytest.fail("the premise: the fused tier should still be compiling after the first "
                    f"call, but it is done ({_fusion_problem(jitted) or 'it compiled'}); "
                    f"torch.fx tracing flag: {fx.tracing()}")


# ------------------------------------------------------------------------ import keraunos

# The torch modules imported once keraunos is (printed as JSON).
_MODULES_AFTER_IMPORT = """
import json, sys, types
import keraunos
print(json.dumps([n for n, m in list(sys.modules.items())
                  if isinstance(m, types.ModuleType) and (n == "torch" or n.startswith("torch."))]))
"""

# Imports the torch modules named in argv[1] (so that the ones keraunos's import would bring in
# are there before it), records every attribute of every torch module and every entry of every
# torch class found in them, imports keraunos, and prints what changed (JSON).
_COMPARE_ACROSS_IMPORT = r"""
import importlib, json, sys, types, warnings

for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception:
        pass

def torch_modules():
    return {n: m for n, m in list(sys.modules.items())
            if isinstance(m, types.ModuleType) and (n == "torch" or n.startswith("torch."))}

def record():
    seen, classes = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch attributes warn when touched
        for name, module in torch_modules().items():
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for attr, value in items:
                if isinstance(value, types.ModuleType):
                    continue
                seen[f"{name}.{attr}"] = value
                if isinstance(value, type) and str(getattr(value, "__module__", "")).startswith("torch"):
                    classes[id(value)] = value
        for cls in classes.values():
            where = f"{cls.__module__}.{cls.__qualname__}"
            for key, entry in list(vars(cls).items()):
                seen[f"{where}.{key}"] = entry
    return seen

def code_like(value):
    # functions, classes, methods, descriptors (staticmethod, classmethod, property, ...):
    # what a patch replaces; plain data (counters, caches) changes as torch runs
    return callable(value) or hasattr(value, "__get__")

before = record()
import keraunos
after = record()
changed = sorted(f"{k}: {before[k]!r} -> {after[k]!r}" for k in before
                 if k in after and after[k] is not before[k]
                 and (code_like(before[k]) or code_like(after[k])))
removed = sorted(k for k in before if k not in after)
added = sorted(f"{k}: {after[k]!r}" for k in after
               if k not in before and code_like(after[k])
               and k.rsplit(".", 1)[0] in {n.rsplit(".", 1)[0] for n in before})
print(json.dumps({"compared": len(before), "changed": changed, "removed": removed, "added": added}))
"""


def test_import_keraunos_replaces_nothing_in_torch():
    """Every function, class and class-dictionary entry reachable from the torch modules that
    exist when keraunos is imported (all those its import brings in are imported first) is the
    same object after ``import keraunos``: nothing patched, wrapped, added or removed."""
    modules = _python(_MODULES_AFTER_IMPORT).strip().splitlines()[-1]
    result = json.loads(_python(_COMPARE_ACROSS_IMPORT, modules).strip().splitlines()[-1])
    assert result["compared"] > 10_000, result["compared"]  # the walk saw torch
    problems = ([f"changed {c}" for c in result["changed"]] + [f"removed {r}" for r in result["removed"]]
                + [f"added {a}" for a in result["added"]])
    assert not problems, f"import keraunos changed {len(problems)} torch attributes:\n" + \
        "\n".join(problems)


# ------------------------------------------------------------- the zoo under the backend

# Every zoo model through torch.compile(backend="keraunos"), one after another, with the
# defaults (KERAUNOS_FUSE unset: fused in the background, never waited for). The eager reference
# calls run under warnings.simplefilter("error"), as under a harness that makes warnings errors;
# the compiled calls do not. Two calls each, then a third call of every model once all have
# run (by then the earlier ones run their fused tiers). Prints the failures as JSON.
_ZOO_IN_A_ROW = r"""
import json, sys, time, traceback, warnings
import torch
import keraunos
import keraunos.dynamo
from keraunos.dynamo.backend import subgraphs_of
from keraunos.testing.zoo import ZOO, assert_same_output, inputs_of, make_models
from keraunos.testing.fuzz.campaign import fusion_failures

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
failures, kept, seconds = [], [], {}

def compare(name, compiled, ref, seed):
    kwargs = inputs_of(name, seed=seed, mask=True, labels=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = ref(**kwargs)
    assert_same_output(compiled(**kwargs), want, tolerance=TOLERANCE)

def failed(name, where, e):
    text = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    failures.append(f"{name} ({where}): {' '.join(text)[:400]}")

for name in ZOO:
    start = time.perf_counter()
    try:
        torch._dynamo.reset()
        model, ref = make_models(name)
        compiled = torch.compile(model, backend="keraunos")
        with torch.no_grad():
            for seed in (1, 2):
                compare(name, compiled, ref, seed)
        if not keraunos.dynamo.last_traces(compiled):
            failures.append(f"{name}: no subgraph went through keraunos")
        kept.append((name, compiled, ref))
    except Exception as e:
        failed(name, "first calls", e)
    seconds[name] = round(time.perf_counter() - start, 1)

for name, compiled, ref in kept:
    try:
        with torch.no_grad():
            compare(name, compiled, ref, 3)
    except Exception as e:
        failed(name, "a call after all models ran", e)
    for sub in subgraphs_of(compiled):
        if keraunos.wait_for_fusion(sub.jitted, 0):
            failures += [f"{name}: its fused tier failed: {f}" for f in fusion_failures(sub.jitted)]
print(json.dumps({"failures": failures, "models": len(ZOO), "seconds": seconds}))
"""


@pytest.mark.long
@needs_cxx
def test_the_zoo_under_the_backend_in_a_row_with_fusion_in_the_background():
    pytest.importorskip("transformers")
    # The defaults a user gets: fusion in the background, and none of the suite's own checks
    # (conftest.py's trace checker and result scan would slow every capture).
    out = _python(_ZOO_IN_A_ROW, timeout=600, KERAUNOS_FUSE=None, KERAUNOS_LINT=None,
                  KERAUNOS_CHECK_RESULTS=None, HF_HUB_OFFLINE="1")
    result = json.loads(out.strip().splitlines()[-1])
    assert not result["failures"], (f"{len(result['failures'])} failures in {result['models']} "
                                    "models:\n" + "\n".join(result["failures"]))


# ---------------------------------------------- torch's compilers on the user's thread


def _small(k: int):
    """A small function with code of its own (Dynamo caches by code object: each one is a new
    compile, never a recompile of an earlier one), and a module calling it."""
    namespace = {"torch": torch}
    source = (f"def small_{k}(x, w):\n"
              f"    return torch.tanh(x @ w) * {1.5 + k} + torch.sigmoid(x).sin() - x.abs() / {2 + k}\n")
    exec(compile(source, f"<small function {k}>", "exec"), namespace)
    fn = namespace[f"small_{k}"]

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 5))

        def forward(self, x):
            return fn(x, self.w)

    torch.manual_seed(k)
    return Small()


def _compile_eager(m, x):
    return torch.compile(m, backend="eager")(x)


def _compile_inductor(m, x):
    return torch.compile(m, backend="inductor")(x)


def _symbolic_trace(m, x):
    for _ in range(5):  # cheap: several, to meet the background's traces more often
        gm = torch.fx.symbolic_trace(m)
        assert any(n.op == "call_function" for n in gm.graph.nodes), gm.graph
    return gm(x)


def _export(m, x):
    return torch.export.export(m, (x,)).module()(x)


@needs_cxx
def test_torch_compilers_on_the_users_thread_during_a_fused_compile(quiet_background):
    """While a fused tier compiles in the background, the user's thread runs ``torch.compile``
    with the eager and Inductor backends, ``torch.fx.symbolic_trace`` and ``torch.export``, each
    on a new small module: each result equals the module's eager result, nothing raises, and
    the jitted model then runs its fused tier with eager's results."""
    actions = [("torch.fx.symbolic_trace", _symbolic_trace), ("torch.compile eager", _compile_eager),
               ("torch.export.export", _export), ("torch.fx.symbolic_trace", _symbolic_trace),
               ("torch.compile inductor", _compile_inductor)]
    counter = itertools.count()
    problems, overlapped = [], 0
    for round_ in range(3):
        jitted, twin, x = _start_slow_compile()
        try:
            _check_premise(jitted)
            for what, action in actions:
                k = next(counter)
                small = _small(k)
                y = torch.randn(3, 5)
                overlapped += _compiling(jitted)
                try:
                    with torch.no_grad():
                        assert_close(action(small, y), small(y), **TOLERANCE)
                except Exception as e:  # noqa: BLE001 - every failure is listed at the end
                    problems.append(f"round {round_}, {what} (small {k}): {type(e).__name__}: "
                                    f"{str(e).strip()[:300]}")
        finally:
            keraunos.wait_for_fusion(jitted, WAIT_S)
        if (why := _fusion_problem(jitted)) is not None:
            problems.append(f"round {round_}: {why}")
        with torch.no_grad():
            assert_close(jitted(x), twin(x), **TOLERANCE)
        if keraunos.compile_stats(jitted).tier != "fused":
            problems.append(f"round {round_}: the jitted model runs {keraunos.compile_stats(jitted).tier}")
    assert overlapped >= len(actions), f"only {overlapped} actions ran during a fused compile"
    assert not problems, "\n".join(problems)


# ------------------------------------------------- process state seen by the user's thread


@needs_cxx
def test_the_users_view_of_the_process_is_unchanged_by_a_fused_compile(quiet_background):
    """Warnings filters, the configs of Dynamo, AOTAutograd and Inductor, grad mode, autocast,
    anomaly detection, the dispatch modes, torch.fx's tracing flag and the classes a trace
    patches, seen from the user's thread, are the same before, during and after a fused compile
    in the background, while that thread enters and leaves ``warnings.catch_warnings()`` with
    ``simplefilter("error")`` (as pytest's ``-W error`` and many harnesses do) around eager
    work; and the fused compile succeeds and gives eager's results."""
    import torch._functorch.config  # noqa: F401 - so that the snapshots compare them (the
    import torch._inductor.config  # noqa: F401   fused compile imports them otherwise)
    problems = []
    for round_ in range(2):
        before = process_state.snapshot()
        jitted, twin, x = _start_slow_compile()
        seen, samples, deadline = {}, 0, time.monotonic() + WAIT_S
        try:
            _check_premise(jitted)
            while _compiling(jitted) and time.monotonic() < deadline:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with torch.no_grad():
                        twin(x)
                for d in process_state.differences(before, process_state.snapshot()):
                    seen.setdefault(d.split(":")[0], f"during the compile: {d}")
                samples += 1
                time.sleep(0.002)
        finally:
            keraunos.wait_for_fusion(jitted, WAIT_S)
        for d in process_state.differences(before, process_state.snapshot()):
            seen.setdefault("after " + d.split(":")[0], f"after the compile: {d}")
        process_state.restore(before, flags=True)  # the next round starts from the same state
        problems += [f"round {round_}: {text}" for text in seen.values()]
        if (why := _fusion_problem(jitted)) is not None:
            problems.append(f"round {round_}: {why}")
        with torch.no_grad():
            assert_close(jitted(x), twin(x), **TOLERANCE)
        assert samples > 0, "the premise: the user's thread ran during the fused compile"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------ freed while compiling


def _slow_function():
    model, twin = _slow_model()

    def f(x):
        return model(x) * 2

    return f, model, twin


@needs_cxx
@pytest.mark.parametrize("kind", ["module", "function"])
def test_a_deleted_jitted_object_is_freed_while_its_fused_tier_compiles(kind, quiet_background):
    """After ``del`` and ``gc.collect()``, neither the jitted object nor what it compiled (the
    module, or the function and the module it calls) is alive, though its fused tier was still
    compiling: a background compile does not keep the user's objects."""
    for round_ in range(2):
        if kind == "module":
            user, twin = _slow_model()
            held = [user]
        else:
            user, model, twin = _slow_function()
            held = [user, model]
            del model
        jitted = keraunos.jit(user, fuse="background")
        x = torch.randn(8, 16)
        with torch.no_grad():
            assert_close(jitted(x), (twin(x) * 2) if kind == "function" else twin(x), **TOLERANCE)
        _check_premise(jitted)
        refs = {"the jitted object": weakref.ref(jitted)}
        refs.update({f"the user's {type(o).__name__}": weakref.ref(o) for o in held})
        # The entry's fused-tier record (it holds nothing of the user's): whether the compile is
        # still under way when the objects are found freed.
        tiering = state_of(jitted).entries[0].tiering
        del jitted, user, held
        gc.collect()
        alive = [name for name, ref in refs.items() if ref() is not None]
        # The background job holds neither the entry nor the jitted callable's state, not even
        # for a moment (tiers.schedule, background.Queue.submit). Under a loaded machine the
        # full suite has still seen them outlive the first collection (the function variant,
        # round 1) by a reference not found yet; what must not happen is that they live on
        # while the fused tier compiles.
        while alive and not tiering.compiled.is_set():
            time.sleep(0.01)
            gc.collect()
            alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, (f"round {round_}: alive after del and gc.collect() until the fused "
                           f"tier compiled: {', '.join(alive)}")


# ------------------------------------------------------------- warnings as errors, fused now

# A whole process under ``warnings.simplefilter("error")`` (``python -W error``, a strict
# harness) compiles a fused program on the user's thread (``fuse="wait"``), Inductor not yet
# imported: importing it makes torch warn about its own deprecated ``torch.jit.script_method``,
# which must neither fail the compile nor reach the user. Prints what it saw as JSON.
_FUSED_NOW_UNDER_ERRORS = r"""
import json, warnings
warnings.simplefilter("error")
import sys, torch
import keraunos
assert "torch._inductor.compile_fx" not in sys.modules
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                            torch.nn.Linear(16, 4))
filters = list(warnings.filters)
jitted = keraunos.jit(model, fuse="wait")
x = torch.randn(3, 8, requires_grad=True)
x_ref = x.detach().clone().requires_grad_()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = jitted(x)
    got.sum().backward()
want = model(x_ref)
want.sum().backward()
print(json.dumps({"regions": len(keraunos.last_fusions(jitted)),
                  "tier": keraunos.compile_stats(jitted).tier,
                  "warnings": [str(w.message) for w in caught],
                  "filters_kept": list(warnings.filters) == filters,
                  "equal": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4)
                                and torch.allclose(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4))}))
"""


@needs_cxx
def test_a_fused_compile_on_the_users_thread_under_warnings_as_errors(tmp_path):
    seen = json.loads(_python(_FUSED_NOW_UNDER_ERRORS, KERAUNOS_CACHE_DIR=str(tmp_path),
                              KERAUNOS_FUSE=None).strip().splitlines()[-1])
    assert seen["warnings"] == [], seen["warnings"]
    assert seen["tier"] == "fused" and seen["regions"] >= 1, seen
    assert seen["equal"] and seen["filters_kept"], seen
