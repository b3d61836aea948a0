"""Helpers the behaviour tests share: a jitted run checked against eager, gradients and all, and
the litgpt model pairs and token batches of the litgpt tests; the program-store tests' runs of a
script in a process of its own.

Tests import it as a sibling module (pytest puts ``tests/`` on ``sys.path``, as for
``distributed_ranks``)::

    from helpers import check_grads

    def test_tanh_matmul_grads_match_eager():
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
        jf = check_grads(lambda x, w: torch.tanh(x @ w), x, w)
        assert keraunos.last_backward_traces(jf)  # what the helper returns, to check more on

Every helper asserts: a comparison that finds nothing to compare fails.
"""
from __future__ import annotations

import copy
import json
import os
import sqlite3
import subprocess
import sys
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_leaves

import keraunos

VOCAB = 256  # the litgpt tests' vocabulary: tokens() draws from it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's keraunos


# ------------------------------------------------------------------------------ gradients
def _named_tensors(holder) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters by name, or a sequence's tensors as "input i"."""
    if isinstance(holder, torch.nn.Module):
        return list(holder.named_parameters())
    return [(f"input {i}", t) for i, t in enumerate(holder) if isinstance(t, torch.Tensor)]


def _compare_grads(got, want, *, require_all: bool, tolerance: dict) -> int:
    """Compares the ``.grad`` of each tensor in ``got`` with eager's in ``want``; returns how many
    gradients it compared."""
    got, want = _named_tensors(got), _named_tensors(want)
    assert [n for n, _ in got] == [n for n, _ in want], "the two sides hold different tensors"
    compared = 0
    for (name, g), (_, w) in zip(got, want):
        if require_all and w.requires_grad:
            assert w.grad is not None, f"eager has no grad for {name}"
        if w.grad is None:
            assert g.grad is None, f"eager has no grad for {name}, keraunos has one"
            continue
        assert g.grad is not None, f"no grad for {name}"
        torch.testing.assert_close(g.grad, w.grad, msg=lambda m, name=name: f"grad of {name}: {m}",
                                   **tolerance)
        compared += 1
    return compared


def assert_grads_match(got: torch.nn.Module | Sequence, want: torch.nn.Module | Sequence, *,
                       require_all: bool = False, rtol: float | None = None,
                       atol: float | None = None) -> None:
    """Every parameter of module ``got`` (or every tensor of a sequence) has eager's gradient: the
    one of the same name in ``want``, or ``None`` where eager's is ``None``. With ``require_all``,
    every tensor that requires grad must have one, eager's too. At least one gradient is compared.

        >>> assert_grads_match(model, ref)            # doctest: +SKIP
        >>> assert_grads_match([x, w], [x_ref, w_ref], rtol=1e-4, atol=1e-4)  # doctest: +SKIP
    """
    tolerance = {} if rtol is None and atol is None else dict(rtol=rtol, atol=atol)
    compared = _compare_grads(got, want, require_all=require_all, tolerance=tolerance)
    assert compared > 0, "no gradient to compare"


def eager_copies(inputs: Sequence) -> list:
    """The inputs for an eager reference run: each leaf tensor that requires grad as a fresh leaf
    of the same values (one copy for a tensor passed twice); everything else as it is."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            assert x.is_leaf, "check_grads compares .grad, which only a leaf tensor gets"
            if id(x) not in copies:
                copies[id(x)] = x.detach().clone().requires_grad_()
            x = copies[id(x)]
        out.append(x)
    return out


def _sum_of_outputs(out) -> torch.Tensor:
    differentiable = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    assert differentiable, "no output requires grad: nothing to backpropagate"
    return sum(t.sum() for t in differentiable)


def check_grads(f: Callable, *inputs: Any, loss: Callable | None = None,
                ref: Callable | None = None, seed: int | None = None, require_all: bool = False,
                rtol: float | None = None, atol: float | None = None,
                jit: Callable = keraunos.jit, **options) -> Callable:
    """Runs ``jit(f, **options)`` and eager ``f`` on the same inputs, then backward through both,
    and asserts they agree: the outputs (and which of them require grad), the loss when ``loss``
    is given, and the gradient of every input and, for a module, of every parameter. Returns the
    jitted ``f``, for the caller to check more on it.

    ``inputs``: leaf tensors that require grad are copied for the eager run; everything else is
    passed to both as it is. ``loss(out)``: the value to backpropagate (default: the sum of every
    output that requires grad). ``ref``: the eager program (default ``f``, or a deep copy of it
    made before the jitted run when ``f`` is a module). ``seed``: ``torch.manual_seed(seed)``
    before each call, for programs that draw random numbers. ``require_all``: every parameter and
    input that requires grad must get a gradient. ``rtol``/``atol``: ``assert_close``'s, for
    every comparison. ``jit``: the compiler (``torch.compile`` with ``backend="keraunos"`` in
    ``options`` for the backend route).

        >>> jf = check_grads(lambda x: x.sin() * x, torch.randn(3, requires_grad=True))
        >>> jmodel = check_grads(torch.nn.Linear(4, 2), torch.randn(5, 4), rtol=1e-4, atol=1e-4)
    """
    if ref is None:
        ref = copy.deepcopy(f) if isinstance(f, torch.nn.Module) else f
    ref_inputs = eager_copies(inputs)
    tolerance = {} if rtol is None and atol is None else dict(rtol=rtol, atol=atol)
    jitted = jit(f, **options)

    def run(program, args):
        if seed is not None:
            torch.manual_seed(seed)
        return program(*args)

    out, ref_out = run(jitted, inputs), run(ref, ref_inputs)
    torch.testing.assert_close(out, ref_out, **tolerance)
    requires_grad = [t.requires_grad for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert requires_grad == [t.requires_grad for t in tree_leaves(ref_out)
                             if isinstance(t, torch.Tensor)], "outputs' requires_grad differ"
    if loss is None:
        value, ref_value = _sum_of_outputs(out), _sum_of_outputs(ref_out)
    else:
        value, ref_value = loss(out), loss(ref_out)
        torch.testing.assert_close(value, ref_value, msg=lambda m: f"loss: {m}", **tolerance)
    value.backward()
    ref_value.backward()
    compared = _compare_grads(inputs, ref_inputs, require_all=require_all, tolerance=tolerance)
    if isinstance(f, torch.nn.Module):
        compared += _compare_grads(f, ref, require_all=require_all, tolerance=tolerance)
    assert compared > 0, "no gradient to compare"
    return jitted


# ------------------------------------------------------------------------------ litgpt
def litgpt_models(config, *, seed: int = 0, perturb: bool = True):
    """litgpt's ``GPT`` for ``config`` with random weights (``torch.manual_seed(seed)``), and an
    identical deep copy to run eagerly. ``nn.Linear``/``nn.Embedding`` start random; norm weights
    start at exactly 1 (or 0 with Gemma's unit offset) and biases at 0, which would hide a dropped
    scale or shift, so ``perturb`` randomizes every 1-d parameter too."""
    from litgpt.model import GPT
    torch.manual_seed(seed)
    model = GPT(config)
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.1)
    return model, copy.deepcopy(model)


def tokens(*shape: int, seed: int, vocab: int = VOCAB, low: int = 0) -> torch.Tensor:
    """Token ids in ``[low, vocab)`` of ``shape``, from a generator of their own (``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, shape, generator=g)


# ------------------------------------------------------------------------- the program store
def run_with_store(script, args: Sequence[str], store, env: dict | None = None) -> dict:
    """Run ``script`` with ``args`` in a process of its own, on this checkout's keraunos, with the
    program store on in ``store`` and fusion off; what its last line printed, as JSON. No
    bytecode is written: a test that changes the script's module never meets a stale .pyc."""
    env = {**os.environ, **(env or {}), "KERAUNOS_CACHE_DIR": str(store),
           "KERAUNOS_PROGRAM_STORE": "1", "KERAUNOS_FUSE": "off",
           "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def program_rows(store) -> list:
    """The program store's rows in ``store`` (none when nothing was ever written there)."""
    path = store / "store.sqlite3"
    if not path.exists():
        return []
    with sqlite3.connect(path) as db:
        if not db.execute("SELECT name FROM sqlite_master WHERE name = 'entries'").fetchall():
            return []
        return db.execute("SELECT key, value FROM entries WHERE namespace = 'program'").fetchall()
