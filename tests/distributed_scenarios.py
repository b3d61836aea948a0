"""What each rank runs for tests/test_distributed.py: ``scenario(rank, world_size)`` functions.

Each returns plain values (lists, floats, bools, strings) that the test compares; an exception
is sent back as the outcome. Every scenario compares keraunos with eager in the same process, on
the same inputs, or with a single-process eager reference computed from every rank's batch.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import keraunos
from keraunos.errors import CaptureError, UnsupportedInputError


def _equal(a, b) -> bool:
    return bool(torch.equal(a, b))


def _close(a, b, tol=1e-5) -> bool:
    return bool(torch.allclose(a, b, rtol=tol, atol=tol))


def _refusal(fn, *args) -> tuple[str, str]:
    try:
        fn(*args)
    except (CaptureError, UnsupportedInputError) as e:
        return type(e).__name__, str(e)
    return "none", "it ran"


# ------------------------------------------------------------------ in-place collectives
def all_reduce_matches_eager(rank, world_size):
    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    jitted = keraunos.jit(f)
    same = []
    for call in range(3):  # the first compiles, the others hit the cache
        x = torch.arange(4.0) + rank * 10 + call
        same.append(_equal(jitted(x.clone()), f(x.clone())))
    trace = str(keraunos.last_traces(jitted)[-1])
    return {"same": same, "hits": keraunos.cache_hits(jitted),
            "functional in trace": "_c10d_functional.all_reduce" in trace
                                   and "wait_tensor" in trace and ".copy_(" in trace}


def all_reduce_of_an_input_writes_it_back(rank, world_size):
    def f(x, op):
        dist.all_reduce(x, op=op)
        return x.sum()

    jitted = keraunos.jit(f)
    same = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.SUM):
        x = torch.tensor([1.0, -2.0, 3.0]) * (rank + 1)
        x_eager = x.clone()
        out, expected = jitted(x, op), f(x_eager, op)
        same.append(_equal(out, expected) and _equal(x, x_eager))
    return same


def gather_scatter_and_broadcast_match_eager(rank, world_size):
    def f(x, gathered, scattered, exchanged, pieces):
        dist.all_gather_into_tensor(gathered, x * 2)
        dist.reduce_scatter_tensor(scattered, torch.cat([x, x + 1]))
        dist.all_to_all_single(exchanged, torch.cat([x, -x]))
        dist.all_gather(pieces, x.sin())
        dist.broadcast(x, src=1)
        return gathered.sum() + scattered.sum() + x

    jitted = keraunos.jit(f)
    results = []
    for call in range(2):
        def inputs():
            x = torch.arange(3.0) + 10 * rank + call
            return [x, torch.zeros(3 * world_size), torch.zeros(3), torch.zeros(6),
                    [torch.zeros(3) for _ in range(world_size)]]
        mine, eager = inputs(), inputs()
        out, expected = jitted(*mine), f(*eager)
        written = all(_equal(a, b) for a, b in zip(mine[:4], eager[:4])) and all(
            _equal(a, b) for a, b in zip(mine[4], eager[4]))
        results.append(_equal(out, expected) and written)
    return results


def functional_collective_gradients_match_eager(rank, world_size):
    import torch.distributed._functional_collectives as funcol

    def f(x):
        gathered = funcol.all_gather_tensor_autograd(x.sin(), 0, dist.group.WORLD)
        return funcol.reduce_scatter_tensor_autograd(gathered.square(), "sum", 0,
                                                     dist.group.WORLD).sum()

    x = torch.arange(4.0, requires_grad=True) + rank
    x = x.detach().requires_grad_()
    x_eager = x.detach().clone().requires_grad_()
    out = keraunos.jit(f)(x)
    out.backward()
    expected = f(x_eager)
    expected.backward()
    return _close(out, expected) and _close(x.grad, x_eager.grad)


def in_place_collective_of_a_tensor_requiring_grad_is_refused(rank, world_size):
    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return (y * x).sum()

    return _refusal(keraunos.jit(f), torch.ones(3, requires_grad=True))


def async_collective_is_refused(rank, world_size):
    def f(x):
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        return x

    return _refusal(keraunos.jit(f), torch.ones(2))


def barrier_and_point_to_point_are_refused(rank, world_size):
    def with_barrier(x):
        dist.barrier()
        return x + 1

    def with_send(x):
        if rank == 0:
            dist.send(x, dst=1)
        else:
            dist.recv(x, src=0)
        return x

    return [_refusal(keraunos.jit(with_barrier), torch.ones(2)),
            _refusal(keraunos.jit(with_send), torch.ones(2))]


# --------------------------------------------------------------------------------- DDP
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


class _WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.net(x) * self.scale


def _batches(world_size, steps=3):
    """Every rank's batch of every step: the same on every rank, so each can build the
    single-process reference from all of them."""
    g = torch.Generator().manual_seed(1234)
    return [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
             for _ in range(world_size)] for _ in range(steps)]


def jitted_model_inside_ddp_trains_like_one_process(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    reference = _model()
    ddp = DDP(keraunos.jit(_model()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses_close = []
    for step in _batches(world_size):
        x, y = step[rank]
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        # One process over every rank's batch: DDP averages the ranks' gradients.
        losses_close.append(_close(loss, F.mse_loss(reference(x), y)))
        ref_opt.zero_grad()
        ref_loss = sum(F.mse_loss(reference(bx), by) for bx, by in step) / world_size
        ref_loss.backward()
        ref_opt.step()
    params_close = all(_close(a, b, 1e-5) for a, b in
                       zip(ddp.module.parameters(), reference.parameters()))
    return {"losses": losses_close, "params": params_close,
            "hits": keraunos.cache_hits(ddp.module)}


def _train_ddp(wrap, module, world_size, rank, steps=3, no_sync_first=False):
    """Losses on this rank and final parameters, training ``wrap(module)`` with SGD; with
    ``no_sync_first``, step 0's gradients accumulate locally (``no_sync()``) into step 1's."""
    model = wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, step in enumerate(_batches(world_size, steps)):
        x, y = step[rank]
        if no_sync_first and i == 0:
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
            continue
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def both_ddp_orders_train_alike(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = {}
    for make in (_model, _WithBuffer):
        for no_sync_first in (False, True):
            eager = _train_ddp(DDP, make(), world_size, rank, no_sync_first=no_sync_first)
            inside = _train_ddp(lambda m: DDP(keraunos.jit(m)), make(), world_size, rank,
                                no_sync_first=no_sync_first)
            jitted_ddp = keraunos.jit(DDP(make()))
            outside = _train_ddp(lambda m: jitted_ddp, None, world_size, rank,
                                 no_sync_first=no_sync_first)
            same = all(
                all(_close(a, b) for a, b in zip(run[0], eager[0]))
                and all(_close(a, b) for a, b in zip(run[1], eager[1]))
                for run in (inside, outside))
            # The ranks' parameters agree (gradients were all-reduced).
            gathered = [torch.zeros_like(outside[1][0]) for _ in range(world_size)]
            dist.all_gather(gathered, outside[1][0])
            agree = all(_equal(g, gathered[0]) for g in gathered)
            results[f"{make.__name__}, no_sync={no_sync_first}"] = (
                same, agree, keraunos.cache_misses(jitted_ddp), keraunos.cache_hits(jitted_ddp))
    return results


def _deep_model():
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
    return torch.nn.Sequential(torch.nn.Linear(6, 32), *layers, torch.nn.Linear(32, 3))


def _record_buckets_and_last_node(model, events):
    """DDP's all-reduce of each bucket, as it starts (a comm hook doing the default all-reduce),
    into ``events``."""
    def all_reduce_recorded(state, bucket):
        events.append("bucket")
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
    model.register_comm_hook(None, all_reduce_recorded)


def _mark_last_keraunos_node(loss, events):
    """``events`` gets "last node" when the backward's last keraunos node starts: the one that
    runs the forward program, whose backward segment is the last to run."""
    from keraunos.autograd.function import _FirstNode
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is _FirstNode._backward_cls:
            node.register_prehook(lambda grads: events.append("last node"))
        stack.extend(f for f, _ in node.next_functions)


def _device(rank):
    """Where this rank computes: its GPU under NCCL (tests/test_distributed_cuda.py), else the
    CPU."""
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def ddp_backward_is_split_at_bucket_boundaries(rank, world_size):
    """Small buckets (bucket_cap_mb=0.005: 5 KB, about one layer each): the backward is one
    autograd node per stretch that fills a bucket, and DDP's reducer starts all-reducing
    buckets before the backward's last node runs. Losses, gradients and parameters equal eager
    DDP's with the same buckets, in both orders, also after a no_sync() step, and fused."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = _device(rank)
    ddp = dict(bucket_cap_mb=0.005, device_ids=[rank] if device.type == "cuda" else None)
    results = {}
    orders = {"eager": lambda m: DDP(m, **ddp),
              "DDP(jit(m))": lambda m: DDP(keraunos.jit(m), **ddp),
              "jit(DDP(m))": lambda m: keraunos.jit(DDP(m, **ddp)),
              # Fused: the backward is cut before fusion, whose regions stay within a node.
              "DDP(jit(m, fuse='wait'))": lambda m: DDP(keraunos.jit(m, fuse="wait"), **ddp)}
    runs = {}
    for order, wrap in orders.items():
        model = wrap(_deep_model().to(device))
        events = []
        _record_buckets_and_last_node(model, events)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads, early = [], [], []
        for i, step in enumerate(_batches(world_size, 4)):
            x, y = (t.to(device) for t in step[rank])
            if i == 1:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
                continue
            loss = F.mse_loss(model(x), y)
            events.clear()
            _mark_last_keraunos_node(loss, events)
            loss.backward()
            # Buckets whose all-reduce started before the backward's last node ran (the first
            # step has one bucket: DDP rebuilds them by the order gradients came in).
            early.append(events.index("last node") if "last node" in events else None)
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs[order] = (losses, grads, [p.detach().clone() for p in model.parameters()], early,
                       events.count("bucket"), model)
    eager = runs.pop("eager")
    for order, (losses, grads, params, early, buckets, model) in runs.items():
        jitted = model.module if order.startswith("DDP(") else model
        backward = str(keraunos.last_backward_traces(jitted)[-1])
        results[order] = {
            "losses": all(_close(a, b) for a, b in zip(losses, eager[0])),
            "grads": all(_close(a, b) for g, h in zip(grads, eager[1]) for a, b in zip(g, h)),
            "params": all(_close(a, b) for a, b in zip(params, eager[2])),
            "buckets": (buckets, eager[4]),
            "early": early,
            "nodes": backward.count("DDP bucket boundary") + 1,
            "misses": keraunos.cache_misses(jitted),
            "fused": "inductor_region" in backward,
        }
    return results


def the_torch_compile_backend_matches_eager(rank, world_size):
    """``torch.compile(..., backend="keraunos")``, the route programs with graph breaks take: an
    in-place all_reduce inside a compiled function (Dynamo remaps it to the functional
    collective), DDP compiled whole (Dynamo's DDPOptimizer splits the graph at the buckets;
    keraunos compiles each piece) training like eager DDP, also with a buffer, and an FSDP2
    model (per block and root) training like eager FSDP2."""
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch._dynamo.reset()

    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1
    compiled = torch.compile(f, backend="keraunos")
    reduced = []
    for call in range(3):
        x = torch.arange(4.0) + rank * 10 + call
        reduced.append(_equal(compiled(x.clone()), f(x.clone())))
    trained = {}
    for make in (_model, _WithBuffer):
        # (DDP's default buckets: DDPOptimizer asserts that the first bucket, 1 MiB, is no
        # larger than the others)
        eager = _train_ddp(DDP, make(), world_size, rank)
        inside = _train_ddp(lambda m: torch.compile(DDP(m), backend="keraunos"),
                            make(), world_size, rank)
        trained[make.__name__] = (
            all(_close(a, b) for a, b in zip(inside[0], eager[0]))
            and all(_close(a, b) for a, b in zip(inside[1], eager[1])))
    eager = _train_fsdp(_fsdp_stack("eager"), rank, world_size)
    compiled_fsdp = torch.compile(_fsdp_stack("eager"), backend="keraunos")
    inside = _train_fsdp(compiled_fsdp, rank, world_size)
    fsdp = all(_close(a, b) for run, ref in zip(inside, eager) for a, b in
               zip(_flat(run), _flat(ref)))
    return {"all_reduce": reduced, "ddp": trained, "fsdp2": fsdp}


def _flat(values):
    return [t for v in values for t in (v if isinstance(v, list) else [v])]


# ------------------------------------------------------------------------------ DTensor
# DTensor and tensor parallel: tests/dtensor_scenarios.py, run in this spawn too.
from dtensor_scenarios import (  # noqa: E402,F401
    dtensor_function_matches_eager, dtensor_op_sweep_matches_eager_or_is_refused,
    dtensor_outputs_reaching_different_inputs_are_refused,
    dtensor_outputs_with_gradients_match_eager,
    dtensor_programs_capture_cannot_replay_are_refused, tensor_parallel_attention_trains_like_eager,
    tensor_parallel_inference_matches_eager, sharded_batch_with_replicated_weight_matches_eager,
    tensor_parallel_mlp_trains_like_eager, tensor_parallel_under_the_torch_compile_backend)


# -------------------------------------------------------------------------- FSDP2 (fully_shard)
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class _Stack(torch.nn.Module):
    """Input layer, two identical blocks (each an FSDP unit), head; ``checkpointed`` blocks
    recompute their forward in the backward (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, checkpointed=False):
        super().__init__()
        self.checkpointed = checkpointed
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def _fsdp_stack(order, checkpointed=False, mp=None):
    """A ``_Stack`` sharded per block and at the root: ``eager``, ``blocks jitted``
    (``fully_shard(keraunos.jit(block))``) or ``model jitted`` (``keraunos.jit`` of it)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = _Stack(checkpointed)
    kwargs = {"mp_policy": mp} if mp is not None else {}
    if order == "blocks jitted":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = keraunos.jit(block)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return keraunos.jit(model) if order == "model jitted" else model


def _train_fsdp(model, rank, world_size, steps=3):
    """Losses, every step's full gradients and the final full parameters on this rank."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in _batches(world_size, steps):
        x, y = step[rank]
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads, [p.detach().full_tensor().clone() for p in model.parameters()]


def _reference_fsdp(world_size, checkpointed=False, steps=3):
    """One process over every rank's batch (FSDP2 averages the ranks' gradients)."""
    torch.manual_seed(0)
    model = _Stack(checkpointed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in _batches(world_size, steps):
        loss = sum(F.mse_loss(model(bx), by) for bx, by in step) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _fsdp_case(rank, world_size, checkpointed=False, mp=None, tol=1e-5, ref_tol=1e-5):
    from keraunos.capture.leaks import capture_values_in
    eager = _train_fsdp(_fsdp_stack("eager", checkpointed, mp), rank, world_size)
    reference = _reference_fsdp(world_size, checkpointed)
    result = {}
    for order in ("blocks jitted", "model jitted"):
        model = _fsdp_stack(order, checkpointed, mp)
        losses, grads, params = _train_fsdp(model, rank, world_size)
        compiled = list(model.blocks) if order == "blocks jitted" else [model]
        result[order] = {
            "losses": all(_close(a, b, tol) for a, b in zip(losses, eager[0])),
            "grads": all(_close(a, b, tol) for g, h in zip(grads, eager[1]) for a, b in zip(g, h)),
            "params": all(_close(a, b, tol) for a, b in zip(params, eager[2])),
            "reference": all(_close(a, b, ref_tol) for a, b in zip(params, reference)),
            "misses": sum(keraunos.cache_misses(c) for c in compiled),
            "programs": _compiled_programs(compiled),
            "hits": sum(keraunos.cache_hits(c) for c in compiled),
            "leak": capture_values_in([list(model.parameters()),
                                       [p.to_local() for p in model.parameters()]]),
        }
    return result


def _compiled_programs(jitted) -> int:
    """How many programs were compiled for these jitted modules' blocks (an entry rebound to an
    identical block shares its computation traces)."""
    from keraunos.runtime.call import state_of
    states = [u for j in jitted for u in getattr(state_of(j), "units", [state_of(j)])]
    return len({id(e.computation_traces) for s in states for e in s.entries})


def fsdp2_jitted_blocks_and_jitted_model_train_like_eager(rank, world_size):
    return _fsdp_case(rank, world_size)


def fsdp2_mixed_precision_trains_like_eager(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # bf16 compute: eager FSDP2 with the same policy closely, the fp32 reference loosely.
    return _fsdp_case(rank, world_size, mp=mp, tol=1e-3, ref_tol=5e-2)


def fsdp2_activation_checkpointing_trains_like_eager(rank, world_size):
    return _fsdp_case(rank, world_size, checkpointed=True)


def fsdp2_units_that_differ_compile_programs_of_their_own(rank, world_size):
    """Units of one class share a program only where the program is proven valid for each: a
    block whose LayerNorm has another eps, or whose Linear has a forward hook (which the
    program runs inline), compiles its own. A hook on the block itself is in the program when
    the block was jitted before fully_shard, and around it (as FSDP2's are) when the sharded
    model was jitted. Each model trains like eager FSDP2."""
    from torch.distributed.fsdp import fully_shard

    def other_eps(model):
        model.blocks[1].norm.eps = 1e-3

    def hooked_linear(model):
        model.blocks[1].fc.register_forward_hook(lambda m, args, out: out * 0.5)

    def hooked_block(model):
        model.blocks[1].register_forward_hook(lambda m, args, out: out * 0.5)

    def equal_eps(model):
        model.blocks[1].norm.eps = float("1e-05")  # an equal value in an object of its own

    result = {}
    for name, change in (("other eps", other_eps), ("hooked linear", hooked_linear),
                         ("hooked block", hooked_block), ("equal eps", equal_eps)):
        runs = {}
        for order in ("eager", "model jitted", "blocks jitted"):
            torch.manual_seed(0)
            model = _Stack()
            change(model)
            if order == "blocks jitted":
                for i, block in enumerate(model.blocks):
                    model.blocks[i] = keraunos.jit(block)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            model = keraunos.jit(model) if order == "model jitted" else model
            runs[order] = (_train_fsdp(model, rank, world_size), model)
        eager = runs.pop("eager")[0]
        for order, (mine, model) in runs.items():
            compiled = [model] if order == "model jitted" else list(model.blocks)
            result[f"{name}, {order}"] = (
                all(_close(a, b) for a, b in zip(mine[0], eager[0]))
                and all(_close(a, b) for a, b in zip(mine[2], eager[2])),
                _compiled_programs(compiled))
    return result


def fsdp2_units_sharded_inside_a_jitted_model_are_refused(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = keraunos.jit(_Stack())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return _refusal(model, torch.randn(2, 6))
