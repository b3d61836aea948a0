"""``keraunos.jit(optimizer.step)``: a torch.optim step captured as one program, compared with
an eager optimizer over several steps (parameters, gradients and every state tensor).

What it rests on: the optimizer is the bound method's ``self``, found by name, so each attribute
the step reads is guarded; its hook dicts (``OrderedDict``) by identity and items; its ``state``
(a ``defaultdict`` keyed by parameters) by position, each key checked to be the parameter the
groups hold; each ``p.grad`` is an input of its own (``None`` by value); the first step, which
creates the state, runs eagerly (``LazyStateError``), and the next one is captured. Python
hyperparameters (a float ``lr``) are compiled in and checked by value, as ``torch.compile``
does: a scheduler that changes a float ``lr`` recompiles; a tensor ``lr`` is read per call.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos import version
from keraunos.errors import FakeKernelError, ScopeMutationError
from helpers import run_with_store


def model_pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.frozen = torch.nn.Parameter(torch.randn(4))  # in the optimizer, never given a grad
    return model, copy.deepcopy(model)


OPTIMIZERS = {
    "adamw": lambda params, lr, foreach: torch.optim.AdamW(
        params, lr=lr, weight_decay=0.1, foreach=foreach),
    "adam-amsgrad-maximize": lambda params, lr, foreach: torch.optim.Adam(
        params, lr=lr, weight_decay=0.05, amsgrad=True, maximize=True, foreach=foreach),
    "sgd-nesterov": lambda params, lr, foreach: torch.optim.SGD(
        params, lr=lr, momentum=0.9, weight_decay=0.1, nesterov=True, foreach=foreach),
    "sgd-dampening": lambda params, lr, foreach: torch.optim.SGD(
        params, lr=lr, momentum=0.5, dampening=0.3, foreach=foreach),
}


def train_both(kind: str, steps: int = 5, *, foreach: bool = False, lr=1e-2, scheduler=False,
               fallback: str = "error", fuse: str = "off", jit_after_scheduler: bool = False):
    """``steps`` training steps of the same model with an eager optimizer and with a jitted
    step; returns the two (model, optimizer) pairs and the jitted step."""
    ours, theirs = model_pair()
    lr_of = (lambda: lr.clone()) if isinstance(lr, torch.Tensor) else (lambda: lr)
    optimizer = OPTIMIZERS[kind](ours.parameters(), lr_of(), foreach)
    eager = OPTIMIZERS[kind](theirs.parameters(), lr_of(), foreach)
    schedulers = []
    if scheduler and not jit_after_scheduler:
        step = keraunos.jit(optimizer.step, fallback=fallback, fuse=fuse)
    if scheduler:
        schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)
                      for o in (optimizer, eager)]
    if not scheduler or jit_after_scheduler:  # optimizer.step: the scheduler's wrapper, if one
        step = keraunos.jit(optimizer.step, fallback=fallback, fuse=fuse)
    for _ in range(steps):
        x = torch.randn(5, 6)
        for model, o, s in ((ours, optimizer, step), (theirs, eager, eager.step)):
            o.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            s()
        for sched in schedulers:
            sched.step()
    return (ours, optimizer), (theirs, eager), step


def assert_trained_alike(ours, theirs):
    (model, optimizer), (reference, eager) = ours, theirs
    compared = 0
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q)
        assert (p.grad is None) == (q.grad is None)
        assert set(optimizer.state[p]) == set(eager.state[q])
        for key, value in eager.state[q].items():
            mine = optimizer.state[p][key]
            assert type(mine) is type(value)  # real tensors, never capture's fakes
            assert_close(mine, value)
            compared += 1
    assert compared  # the state was created and compared
    assert optimizer.param_groups[0]["lr"] == eager.param_groups[0]["lr"] or \
        torch.equal(optimizer.param_groups[0]["lr"], eager.param_groups[0]["lr"])


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_jitted_step_trains_like_eager(kind):
    ours, theirs, step = train_both(kind)
    assert_trained_alike(ours, theirs)
    assert keraunos.cache_misses(step) == 2  # the first step ran eagerly, the second captured
    assert keraunos.cache_hits(step) == 3
    # The parameter without a gradient (the first: a module's own come first) is skipped, its
    # grad checked to be None.
    assert "params_0_updated" not in str(keraunos.last_traces(step)[-1])
    assert "['params'][0].grad == None" in str(keraunos.last_prologue_traces(step)[-1])


@pytest.mark.parametrize("kind", ["adamw", "sgd-nesterov"])
def test_the_fused_tier_trains_like_eager(kind):
    ours, theirs, step = train_both(kind, fuse="wait")
    assert_trained_alike(ours, theirs)
    if kind == "adamw":  # (SGD's few ops per parameter are not worth fusing: decided per program)
        assert keraunos.compile_stats(step).tier == "fused"


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_fused_tier_with_a_tensor_learning_rate_and_a_scheduler_trains_like_eager(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no region Inductor could not compile
        warnings.filterwarnings("ignore", "Detected call of")  # jitted before the scheduler
        ours, theirs, step = train_both(kind, steps=5, lr=torch.tensor(1e-2), scheduler=True,
                                        fuse="wait")
    assert_trained_alike(ours, theirs)
    assert keraunos.cache_misses(step) == 2 and keraunos.last_fusions(step)


def test_the_step_writes_parameters_and_state_in_place_without_a_backward():
    ours, theirs, step = train_both("adamw", steps=3)
    assert_trained_alike(ours, theirs)
    assert not keraunos.last_backward_traces(step)  # all of it runs under no_grad
    assert "copy_" not in str(keraunos.last_epilogue_traces(step)[-1])  # written in place


@pytest.mark.parametrize("kind", ["sgd-nesterov", "sgd-dampening"])
def test_a_foreach_sgd_step_is_captured_and_trains_like_eager(kind):
    ours, theirs, step = train_both(kind, foreach=True)
    assert_trained_alike(ours, theirs)
    assert "_foreach_add_" in str(keraunos.last_traces(step)[-1])


@pytest.mark.parametrize("kind", ["adamw", "adam-amsgrad-maximize"])
def test_a_foreach_adam_step_falls_back_to_the_dynamo_route_and_trains_like_eager(kind):
    # Under tracing, foreach Adam passes its step sizes as a CPU tensor to _foreach_addcdiv_,
    # whose fake kernel rejects it up to torch 2.14 (its real kernel takes it); from 2.15 the
    # fake kernel takes it too, and keraunos captures the step.
    release = version.release_of(torch.__version__)
    if release <= (2, 14):
        with pytest.raises(FakeKernelError, match="_foreach_addcdiv_"):
            train_both(kind, foreach=True)
    else:
        ours, theirs, step = train_both(kind, foreach=True)
        assert_trained_alike(ours, theirs)
        assert keraunos.cache_misses(step) >= 1 and keraunos.cache_hits(step) >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning
        ours, theirs, _ = train_both(kind, foreach=True, fallback="dynamo")
    assert_trained_alike(ours, theirs)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_float_learning_rate_changed_by_a_scheduler_becomes_a_symbol_and_trains_like_eager(kind):
    ours, theirs, step = train_both(kind, steps=6, scheduler=True)
    assert_trained_alike(ours, theirs)
    # Compiled in on the first capture (after the eager call that makes the state), a symbol
    # from the first change on: the later changes hit.
    assert keraunos.cache_misses(step) == 3 and keraunos.cache_hits(step) == 3
    assert any("['lr'] changed" in reason and "recompiled with it symbolic" in reason
               for reason in keraunos.last_cache_miss_reasons(step))


FRESH_PROCESS_STEP = """
import json, torch, torch.nn.functional as F, keraunos
def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, 0.5, total_steps=30)
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        scheduler.step()
        return loss
    return model, step
(model, step), (eager_model, eager_step) = build(), build()
jitted = keraunos.jit(step, fallback="error")
torch.manual_seed(1)
for _ in range(10):
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    torch.testing.assert_close(jitted(x, y), eager_step(x, y))
for p, q in zip(model.parameters(), eager_model.parameters()):
    torch.testing.assert_close(p, q)
print(json.dumps([keraunos.cache_misses(jitted), keraunos.cache_hits(jitted)]))
"""


def test_a_rate_and_momentum_a_scheduler_cycles_become_symbols_in_a_fresh_process(tmp_path):
    # A fresh process: the ShapeEnv's first symbol imports modules, inside the capture (which
    # must not take their code for the program's).
    script = tmp_path / "step.py"
    script.write_text(FRESH_PROCESS_STEP)
    misses, hits = run_with_store(script, [], tmp_path / "store")
    assert (misses, hits) == (3, 7)


@pytest.mark.parametrize("jit_after_scheduler", [False, True])
def test_a_tensor_learning_rate_changed_by_a_scheduler_does_not_recompile(jit_after_scheduler):
    ours, theirs, step = train_both("adam-amsgrad-maximize", steps=6, lr=torch.tensor(1e-2),
                                    scheduler=True, jit_after_scheduler=jit_after_scheduler)
    assert_trained_alike(ours, theirs)
    assert keraunos.cache_misses(step) == 2 and keraunos.cache_hits(step) == 4


def test_a_parameter_that_gets_its_first_gradient_later_creates_its_state_eagerly():
    ours, theirs = model_pair()
    optimizer = torch.optim.Adam(ours.parameters(), lr=1e-2)
    eager = torch.optim.Adam(theirs.parameters(), lr=1e-2)
    step = keraunos.jit(optimizer.step, fallback="error")
    for i in range(5):
        for model, o, s in ((ours, optimizer, step), (theirs, eager, eager.step)):
            o.zero_grad(set_to_none=True)
            loss = model(torch.ones(2, 6)).sum()
            if i >= 2:  # from the third step on, the frozen parameter trains too
                loss = loss + model.frozen.square().sum()
            loss.backward()
            s()
    assert_trained_alike((ours, optimizer), (theirs, eager))
    assert "params_0_updated" in str(keraunos.last_traces(step)[-1])


def halve_gradients(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


def test_a_hook_registered_after_compiling_is_seen_and_captured():
    (model, optimizer), (reference, eager), step = train_both("adamw", steps=2)
    for o in (optimizer, eager):
        o.register_step_pre_hook(halve_gradients)
    for _ in range(3):
        for m, o, s in ((model, optimizer, step), (reference, eager, eager.step)):
            o.zero_grad(set_to_none=True)
            m(torch.ones(2, 6)).sum().backward()
            s()
    assert_trained_alike((model, optimizer), (reference, eager))
    assert any("_optimizer_step_pre_hooks" in r
               for r in keraunos.last_cache_miss_reasons(step))
    assert "mul_(0.5)" in str(keraunos.last_traces(step)[0])  # the hook runs in the program
    assert keraunos.cache_misses(step) == 3 and keraunos.cache_hits(step) == 2


def test_a_hook_that_changes_python_state_is_refused_not_dropped():
    (model, optimizer), _, step = train_both("adamw", steps=2)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    model(torch.ones(2, 6)).sum().backward()
    with pytest.raises(ScopeMutationError, match="closure"):
        step()
    assert calls == []  # undone


def test_a_replaced_parameter_is_not_stepped_with_the_old_ones_state():
    (model, optimizer), (reference, eager), step = train_both("sgd-nesterov", steps=3)
    for m, o in ((model, optimizer), (reference, eager)):
        fresh = torch.nn.Parameter(m[0].bias.detach().clone())
        o.param_groups[0]["params"][1] = fresh  # same metadata, another tensor: no state yet
        m[0].bias = fresh
    for m, o, s in ((model, optimizer, step), (reference, eager, eager.step)):
        o.zero_grad(set_to_none=True)
        m(torch.ones(2, 6)).sum().backward()
        s()
    assert_trained_alike((model, optimizer), (reference, eager))


def test_a_gradient_read_by_a_jitted_function_is_an_input_of_its_own():
    p = torch.nn.Parameter(torch.randn(3))
    doubled = keraunos.jit(lambda p: p.grad * 2 if p.grad is not None else p * 0)
    p.grad = torch.ones(3)
    assert_close(doubled(p), torch.full((3,), 2.0))
    p.grad = torch.full((3,), 5.0)  # another gradient tensor: read per call, not baked in
    assert_close(doubled(p), torch.full((3,), 10.0))
    p.grad = None
    assert_close(doubled(p), torch.zeros(3))
    assert keraunos.cache_misses(doubled) == 2  # None is checked by value


def test_the_fused_step_runs_each_parameters_update_in_a_region():
    ours, theirs, step = train_both("adamw", fuse="wait")
    assert_trained_alike(ours, theirs)
    fused = str(keraunos.last_traces(step)[-1])
    assert "Functionalize Writes" in fused
    # No write of a parameter or moment estimate is left outside the regions; the step counts
    # (0-dim, read by the bias corrections) are counted once each on the torch executor.
    outside = [line for line in fused.splitlines()
               if not line.lstrip().startswith("#") and ("_(" in line or ".copy_(" in line)]
    assert outside and all(line.strip().endswith("_step_updated.add_(1)") for line in outside), \
        outside
    assert "inductor_region" in fused


def test_a_chain_of_writes_of_an_input_fuses_and_matches_eager():
    def update(x, g):
        x.mul_(0.9).add_(g, alpha=0.1)
        x.clamp_(-1.0, 1.0)
        return x.sum()

    x, g = torch.randn(8, 8), torch.randn(8, 8)
    reference = x.clone()
    jitted = keraunos.jit(update, fuse="wait")
    for _ in range(3):
        assert_close(jitted(x, g), update(reference, g))
        assert_close(x, reference)
    assert "Functionalize Writes" in str(keraunos.last_traces(jitted)[-1])


def test_a_written_tensor_with_a_view_keeps_its_in_place_writes():
    def update(x, g):
        row = x[0]
        x.mul_(0.5).add_(g)
        return row * 2  # reads the written memory through the view

    x, g = torch.randn(4, 4), torch.randn(4, 4)
    reference = x.clone()
    jitted = keraunos.jit(update, fuse="wait")
    for _ in range(2):
        assert_close(jitted(x, g), update(reference, g))
        assert_close(x, reference)
    assert "Functionalize Writes" not in str(keraunos.last_traces(jitted)[-1])


class _CompilerPathFails(torch.nn.Module):
    """As transformers' LongT5 encoder: the mask is made only when not compiling, and read
    anyway."""

    def forward(self, x, mask=None):
        if mask is None and not torch.compiler.is_compiling():
            mask = torch.ones_like(x)
        return x * mask.shape[0]


def test_a_program_whose_compiler_path_fails_is_captured_as_eager_runs_it():
    model, x = _CompilerPathFails(), torch.randn(3, 2)
    jitted = keraunos.jit(model)
    for _ in range(2):
        assert_close(jitted(x), model(x))
    assert keraunos.compile_stats(jitted).cache_hits == 1  # one capture, then cached

    def own_error(x):  # fails on both paths: eager's error, once
        return x @ torch.ones(5, 5)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        keraunos.jit(own_error)(x)


def test_is_compiling_is_true_only_on_the_capturing_thread():
    """Under capture ``torch.compiler.is_compiling()`` answers true for the capturing thread
    (so ``torch.optim`` takes its traceable path), and false for any other thread meanwhile."""
    import threading

    seen_elsewhere = []

    def f(x):
        inside = torch.compiler.is_compiling()
        t = threading.Thread(target=lambda: seen_elsewhere.append(torch.compiler.is_compiling()))
        t.start()
        t.join()
        return x + 1 if inside else x - 1

    x = torch.randn(3)
    assert torch.equal(keraunos.jit(f)(x), x + 1)
    assert seen_elsewhere == [False]
    assert not torch.compiler.is_compiling()
