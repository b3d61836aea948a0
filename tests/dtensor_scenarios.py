"""DTensor and tensor parallel scenarios, run by tests/test_distributed.py in its one spawn.

Each compares keraunos with eager DTensor on the same inputs in the same process (every rank
draws the same batches: the runner seeds every scenario alike), and returns plain values.
"""
from __future__ import annotations

import copy
import warnings

import torch

import keraunos
from keraunos.capture.leaks import capture_values_in
from keraunos.errors import CaptureError, UnsupportedInputError


def _mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world_size,))


def _same_dtensor(expected, got, tol=None) -> bool:
    """Same type, spec and local values (what each rank holds)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    # Eager's collectives hand back a tensor whose wait comes at its first use; keraunos's
    # program waits in the trace and returns the plain tensor.
    if type(expected) is AsyncCollectiveTensor:
        expected = expected.wait()
    if type(expected) is not type(got):
        return False
    if isinstance(expected, DTensor):
        if expected.placements != got.placements or expected.shape != got.shape:
            return False
        expected, got = expected.to_local(), got.to_local()
    if tol is None:
        return bool(torch.equal(expected, got))
    return bool(torch.allclose(expected, got, rtol=tol, atol=tol))


def _text(traces) -> str:
    return "\n".join(str(t) for t in traces)


def _tp_mlp():
    """A Linear-ReLU-Linear block and the Megatron plan for it: column-wise, then row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    return block, {"0": ColwiseParallel(), "2": RowwiseParallel()}


_PLACEMENTS = []  # the placements a jitted function redistributes to, found by name


def _redistributed(x):
    return (x * 2).redistribute(x.device_mesh, _PLACEMENTS)


def dtensor_function_matches_eager(rank, world_size):
    """A function of DTensors returning DTensors (sharded, replicated by an explicit
    redistribute, partial), without gradients; then an input of other placements."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    a = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])

    def f(a, b):
        c = (a @ b).relu() * 2
        return c, c.redistribute(mesh, [Replicate()]), c.sum()
    jf = keraunos.jit(f)
    same = []
    for _ in range(2):
        expected, got = f(a, b), jf(a, b)
        same.append(all(_same_dtensor(e, g) for e, g in zip(expected, got)))
    text = _text(keraunos.last_traces(jf))
    checks = _text(keraunos.last_prologue_traces(jf))
    replicated = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
    resharded = all(_same_dtensor(e, g) for e, g in zip(f(replicated, b), jf(replicated, b)))
    # One DTensor passed twice, then two of the same spec: not the same program.
    add = keraunos.jit(lambda x, y: x + y)
    other = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    twice = [_same_dtensor(a + a, add(a, a)), _same_dtensor(a + other, add(a, other))]
    # Placements the program finds by name are compared by value: changed, they recompile.
    global _PLACEMENTS
    redistributed, found_by_name = keraunos.jit(_redistributed), []
    for placements in ([Replicate()], [Replicate()], [Shard(1)]):
        _PLACEMENTS = placements
        found_by_name.append(_same_dtensor(_redistributed(a), redistributed(a)))
    found_by_name.append(keraunos.cache_misses(redistributed))
    return {"same": same, "leak": capture_values_in(got), "resharded": resharded,
            "misses": keraunos.cache_misses(jf), "hits": keraunos.cache_hits(jf),
            "same DTensor twice": twice, "placements found by name": found_by_name,
            "gather in trace": "torch.ops._c10d_functional.all_gather_into_tensor" in text,
            "spec checked": "placements (Shard(dim=0),)" in checks}


def tensor_parallel_inference_matches_eager(rank, world_size):
    from torch.distributed.tensor.parallel import parallelize_module
    block, plan = _tp_mlp()
    model = parallelize_module(block, _mesh(world_size), plan)
    jm = keraunos.jit(model)
    same = []
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 6)
            same.append(_same_dtensor(model(x), jm(x)))
    text = _text(keraunos.last_traces(jm))
    return {"same": same, "hits": keraunos.cache_hits(jm),
            "all_reduce in trace": "torch.ops._c10d_functional.all_reduce" in text}


def _train(model, reference, run, steps, x_requires_grad):
    """Losses, gradients and parameters of ``run`` (the model or its compiled form) against
    eager ``reference`` on the same batches, SGD after each step."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd_reference = torch.optim.SGD(reference.parameters(), lr=0.1)
    result = {"losses": [], "grads": [], "params": [], "input grads": []}
    for _ in range(steps):
        x = torch.randn(5, 6, requires_grad=x_requires_grad)
        x_reference = x.detach().clone().requires_grad_(x_requires_grad)
        loss = run(x).pow(2).sum()
        loss.backward()
        loss_reference = reference(x_reference).pow(2).sum()
        loss_reference.backward()
        result["losses"].append(_same_dtensor(loss_reference.detach(), loss.detach(), 1e-5))
        result["grads"].append(all(_same_dtensor(e.grad, g.grad, 1e-5) for e, g in zip(
            reference.parameters(), model.parameters())))
        if x_requires_grad:
            result["input grads"].append(_same_dtensor(x_reference.grad, x.grad, 1e-5))
        sgd.step(), sgd_reference.step()
        sgd.zero_grad(), sgd_reference.zero_grad()
        result["params"].append(all(_same_dtensor(e.detach(), g.detach(), 1e-5) for e, g in zip(
            reference.parameters(), model.parameters())))
    return result


def tensor_parallel_mlp_trains_like_eager(rank, world_size):
    """ColwiseParallel then RowwiseParallel, 3 SGD steps under keraunos.jit; with an input
    that requires grad, ColwiseParallel's from_local all-reduces its gradient in the backward."""
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = _mesh(world_size)
    results = {}
    for case, x_requires_grad in (("parameters", False), ("parameters and input", True)):
        block, plan = _tp_mlp()
        reference = parallelize_module(copy.deepcopy(block), mesh, plan)
        model = parallelize_module(block, mesh, plan)
        jm = keraunos.jit(model)
        r = _train(model, reference, jm, 3, x_requires_grad)
        r["misses"], r["hits"] = keraunos.cache_misses(jm), keraunos.cache_hits(jm)
        r["forward all_reduce"] = "torch.ops._c10d_functional.all_reduce" in _text(
            keraunos.last_traces(jm)[-1:])
        r["backward all_reduce"] = "torch.ops._c10d_functional.all_reduce" in _text(
            keraunos.last_backward_traces(jm)[-1:])
        results[case] = r
    return results


class _Attention(torch.nn.Module):
    """Causal self-attention after a LayerNorm, with a residual: q, k, v column-wise (each rank
    computes its heads), o row-wise."""

    def __init__(self, width=16, heads=4):
        super().__init__()
        self.head_size = width // heads
        self.norm = torch.nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        y = self.norm(x)
        q, k, v = (p(y).view(b, t, -1, self.head_size).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, -1))


def tensor_parallel_attention_trains_like_eager(rank, world_size):
    """Plain parameters (the norm) and DTensor ones, views, SDPA, a residual: 2 SGD steps."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = _mesh(world_size)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel()}
    torch.manual_seed(0)
    block = _Attention()
    reference = parallelize_module(copy.deepcopy(block), mesh, plan)
    model = parallelize_module(block, mesh, plan)
    jm = keraunos.jit(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd_reference = torch.optim.SGD(reference.parameters(), lr=0.1)
    result = {"losses": [], "grads": [], "params": []}
    for _ in range(2):
        x = torch.randn(2, 5, 16)
        loss, loss_reference = jm(x).pow(2).mean(), reference(x).pow(2).mean()
        loss.backward(), loss_reference.backward()
        result["losses"].append(_same_dtensor(loss_reference.detach(), loss.detach(), 1e-5))
        result["grads"].append(all(_same_dtensor(e.grad, g.grad, 1e-5) for e, g in zip(
            reference.parameters(), model.parameters())))
        sgd.step(), sgd_reference.step()
        sgd.zero_grad(), sgd_reference.zero_grad()
        result["params"].append(all(_same_dtensor(e.detach(), g.detach(), 1e-5) for e, g in zip(
            reference.parameters(), model.parameters())))
    result["hits"] = keraunos.cache_hits(jm)
    return result


def dtensor_outputs_with_gradients_match_eager(rank, world_size):
    """A jitted function returning DTensors (sharded and partial) of a DTensor parameter; the
    loss is computed on them outside, through redistributions of their own."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    w = distribute_tensor(torch.randn(4, 4), mesh, [Shard(1)]).requires_grad_()
    w_reference = distribute_tensor(w.full_tensor().detach(), mesh, [Shard(1)]).requires_grad_()

    def f(x, w):
        y = (x @ w).tanh()
        return y, y.sum()
    jf = keraunos.jit(f)
    same, grads = [], []
    for _ in range(2):
        x = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
        results = []
        for fn, weight in ((f, w_reference), (jf, w)):
            y, total = fn(x, weight)
            (y.full_tensor().pow(2).sum() + total.full_tensor()).backward()
            results.append((y, total))
        same.append(all(_same_dtensor(e.detach(), g.detach(), 1e-5)
                        for e, g in zip(*results)))
        grads.append(_same_dtensor(w_reference.grad, w.grad, 1e-5))
    return {"same": same, "grads": grads, "hits": keraunos.cache_hits(jf)}


def sharded_batch_with_replicated_weight_matches_eager(rank, world_size):
    """A batch sharded over the ranks times a replicated weight, with dropout: the weight's
    gradient is ``Partial`` in eager (a sum over the shards yet to be made), and the jitted
    program hands it back so; dropout draws what eager draws after the same seed."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    w = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]).requires_grad_()
    w_reference = distribute_tensor(w.full_tensor().detach(), mesh, [Replicate()]).requires_grad_()

    def f(x, w):
        return torch.nn.functional.dropout(x @ w, 0.5).relu().sum()
    jf = keraunos.jit(f)
    same, grads = [], []
    for step in range(2):
        x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        torch.manual_seed(step)
        expected = f(x, w_reference)
        expected.full_tensor().backward()
        torch.manual_seed(step)
        got = jf(x, w)
        got.full_tensor().backward()
        same.append(_same_dtensor(expected.detach(), got.detach(), 1e-5))
        grads.append(_same_dtensor(w_reference.grad, w.grad, 1e-5))
    return {"same": same, "grads": grads, "placements": str(w.grad.placements)}


def tensor_parallel_under_the_torch_compile_backend(rank, world_size):
    """torch.compile(backend="keraunos") of the same block: every graph compiled by keraunos
    (none run eagerly), trains like eager, and its forward shows the all-reduce."""
    from torch.distributed.tensor.parallel import parallelize_module
    import keraunos.dynamo
    block, plan = _tp_mlp()
    mesh = _mesh(world_size)
    reference = parallelize_module(copy.deepcopy(block), mesh, plan)
    model = parallelize_module(block, mesh, plan)
    compiled = torch.compile(model, backend="keraunos")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = _train(model, reference, compiled, 2, False)
        with torch.no_grad():
            x = torch.randn(5, 6)
            r["no_grad"] = _same_dtensor(reference(x), compiled(x), 1e-5)
    r["ran eagerly"] = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    r["all_reduce in trace"] = any("torch.ops._c10d_functional.all_reduce" in _text(s.forward)
                                   for s in keraunos.dynamo.last_traces(compiled))
    return r


def _refusal(fn, *args) -> tuple[str, str]:
    try:
        fn(*args)
    except (CaptureError, UnsupportedInputError) as e:
        return type(e).__name__, str(e)
    return "none", "it ran"


def dtensor_programs_capture_cannot_replay_are_refused(rank, world_size):
    """Refused, not wrong: a DTensor program with gradients that writes a tensor in place; a
    program reading a DTensor's ``.grad`` (the stand-in's would be None: an optimizer step that
    checks ``p.grad is not None`` would silently skip)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    w = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]).requires_grad_()
    counter = distribute_tensor(torch.zeros(4), mesh, [Replicate()])
    x = distribute_tensor(torch.randn(2, 4), mesh, [Replicate()])

    def f(x, w, counter):
        counter.add_(1)
        return x @ w
    (x @ w).sum().backward()

    def step(w):
        if w.grad is not None:
            w -= 0.1 * w.grad
    with torch.no_grad():
        grad_read = _refusal(keraunos.jit(step), w)
    # b is made Shard(0) inside the addition (a redistribution with no backward of its own):
    # eager's b.grad is sharded otherwise than b, which to_local() cannot hand back.
    a = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]).requires_grad_()
    return {"in place": _refusal(keraunos.jit(f), x, w, counter), "grad read": grad_read,
            "resharded gradient": _refusal(keraunos.jit(lambda a, b: a + b), a, b)}


def dtensor_outputs_reaching_different_inputs_are_refused(rank, world_size):
    """Two outputs of which only one reaches ``v``: eager leaves ``v.grad`` None when only the
    other gets a gradient, which one autograd node per program cannot tell: refused."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = _mesh(world_size)
    w = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]).requires_grad_()
    v = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]).requires_grad_()
    x = distribute_tensor(torch.randn(2, 4), mesh, [Replicate()])
    try:
        keraunos.jit(lambda x, w, v: (x @ w, x @ v @ w))(x, w, v)
    except (CaptureError, UnsupportedInputError) as e:
        return type(e).__name__, str(e)
    return "none", "it ran"


def dtensor_op_sweep_matches_eager_or_is_refused(rank, world_size):
    """12 ops over every pair of Shard(0)/Shard(1)/Replicate inputs, with and without
    gradients: each combination eager DTensor runs is either equal to eager under keraunos.jit
    (results, and with gradients the inputs' gradients) or refused by capture; never different."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    F = torch.nn.functional
    ops = {
        "add": lambda a, b: a + b * 2,
        "sum(0)": lambda a, b: (a * b).sum(0),
        "sum(1)": lambda a, b: (a - b).sum(1),
        "mean": lambda a, b: (a * b).mean(),
        "softmax": lambda a, b: F.softmax(a + b, dim=-1),
        "a @ b.t()": lambda a, b: a @ b.t(),
        "a.t() @ b": lambda a, b: (a.t() * 2) @ b,
        "reshape": lambda a, b: (a + b).reshape(-1),
        "cat": lambda a, b: torch.cat([a, b], 0).tanh(),
        "gelu, layer_norm": lambda a, b: F.layer_norm(F.gelu(a + b), (6,)),
        "amax": lambda a, b: (a + b).amax(dim=0),
        "redistribute": lambda a, b: (a + b).redistribute(mesh, [Replicate()]).exp(),
    }
    placements = [[Shard(0)], [Shard(1)], [Replicate()]]
    counts = {"eager refuses": 0, "same": 0, "refused": 0}
    different = []
    seed = 0
    for name, op in ops.items():
        for pa in placements:
            for pb in placements:
                for grad in (False, True):
                    seed += 1
                    torch.manual_seed(seed)
                    A, B = torch.randn(4, 6), torch.randn(4, 6)

                    def inputs():
                        return (distribute_tensor(A, mesh, pa).requires_grad_(grad),
                                distribute_tensor(B, mesh, pb).requires_grad_(grad))
                    ea, eb = inputs()
                    try:
                        expected = op(ea, eb)
                    except Exception:  # noqa: BLE001 - a combination eager DTensor refuses
                        counts["eager refuses"] += 1
                        continue
                    ka, kb = inputs()
                    try:
                        got = keraunos.jit(op)(ka, kb)
                    except (CaptureError, UnsupportedInputError):
                        counts["refused"] += 1
                        continue
                    same = _same_dtensor(expected.detach(), got.detach(), 1e-5)
                    if grad and same:
                        expected.full_tensor().pow(2).sum().backward()
                        got.full_tensor().pow(2).sum().backward()
                        same = _same_dtensor(ea.grad, ka.grad, 1e-5) and \
                            _same_dtensor(eb.grad, kb.grad, 1e-5)
                    if same:
                        counts["same"] += 1
                    else:
                        different.append(f"{name} {pa} {pb} grad={grad}")
    return {"counts": counts, "different": different}
