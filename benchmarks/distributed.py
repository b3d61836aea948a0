"""A DDP and an FSDP2 training step on 2 local gloo ranks: eager vs keraunos vs torch.compile.

Run: python benchmarks/distributed.py [--steps N] [--layers L] [--width W] [--skip-compile]
     [--sections ddp,fsdp,tp] [--bucket-cap-mb MB]

Every system trains the same small litgpt GPT (random weights) with SGD, on the same batches,
in the same two processes (gloo over 127.0.0.1, one intra-op thread each); the systems take
turns, one round of a few steps each, so that a noisy moment costs every system alike. Printed:
each system's median step (rank 0's, over the last rounds), its ratio to eager's, its first
step (compile included), and whether its losses matched eager's.

- DDP: eager `DDP(m)`, keraunos `DDP(keraunos.jit(m))` and `keraunos.jit(DDP(m))` (the same by
  design; the backward split at DDP's bucket boundaries), the first again with the backward as
  one autograd node (a DDP that hides its forward from keraunos: the split's own effect), and
  `DDP(torch.compile(m))` (DDPOptimizer splits its graph at bucket boundaries; it needs
  `--bucket-cap-mb` >= 1: it asserts that the first bucket is no larger than the others).
- FSDP2: `fully_shard` per block and root; keraunos where `keraunos.jit` of it works (it says
  `refused` otherwise), and `torch.compile` per block, as torchtitan does.
- Tensor parallel: each block's MLP `parallelize_module`d (ColwiseParallel fc_1 and fc_2,
  RowwiseParallel proj); eager, `keraunos.jit` of the model, the keraunos backend, and
  `torch.compile` (Inductor).

On CPU with gloo this measures overheads only: communication is a memcpy between two local
processes (gloo's threads do it while the backward runs, so the split at DDP's bucket
boundaries overlaps it here too, on cores the backward does not use). What a GPU run with NCCL
has to show is in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import datetime
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def make_model(layers: int, width: int):
    import litgpt
    from litgpt.model import GPT
    config = litgpt.Config.from_name("Llama-2-7b-hf", n_layer=layers, n_embd=width,
                                     n_head=max(width // 64, 1), n_query_groups=max(width // 64, 1),
                                     intermediate_size=width * 3, padded_vocab_size=512,
                                     vocab_size=512, block_size=64)
    torch.manual_seed(0)
    return GPT(config)


def _ddp_systems(args):
    import keraunos
    from torch.nn.parallel import DistributedDataParallel as DDP
    _Unmarked = _unmarked_ddp()
    cap = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    systems = {
        "eager DDP(m)": lambda m: DDP(m, **cap),
        "keraunos DDP(jit(m))": lambda m: DDP(keraunos.jit(m), **cap),
        "keraunos jit(DDP(m))": lambda m: keraunos.jit(DDP(m, **cap)),
        "keraunos DDP(jit(m)), backward 1 node": lambda m: _Unmarked(keraunos.jit(m), **cap),
    }
    if not args.skip_compile:
        systems["torch.compile DDP(compile(m))"] = lambda m: DDP(torch.compile(m), **cap)
    return systems


def _unmarked_ddp():
    """DDP that does not mark its forward as DDP's (``_get_active_ddp_module`` stays None):
    keraunos then compiles the backward as one autograd node, as before the split at bucket
    boundaries; for comparison only."""
    import contextlib
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Unmarked(DDP):
        @contextlib.contextmanager
        def _inside_ddp_forward(self):
            yield
    return Unmarked


def _fsdp_systems(args):
    import keraunos
    from torch.distributed.fsdp import fully_shard

    def shard(m, per_block=None):
        for block in m.transformer.h:
            if per_block is not None:
                per_block(block)
            fully_shard(block)
        fully_shard(m)
        return m
    systems = {
        "eager FSDP2": lambda m: shard(m),
        "keraunos jit(FSDP2(m))": lambda m: keraunos.jit(shard(m)),
    }
    if not args.skip_compile:
        systems["torch.compile FSDP2, per block"] = lambda m: shard(m, lambda b: b.compile())
    return systems


def _tp_systems(args):
    """Tensor parallel: each block's MLP column-wise (fc_1, fc_2) then row-wise (proj), the
    rest replicated; every rank sees the same batches."""
    import keraunos
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def tp(m):
        for block in m.transformer.h:
            parallelize_module(block.mlp, mesh, {"fc_1": ColwiseParallel(),
                                                 "fc_2": ColwiseParallel(),
                                                 "proj": RowwiseParallel()})
        return m
    systems = {
        "eager TP(m)": tp,
        "keraunos jit(TP(m))": lambda m: keraunos.jit(tp(m)),
    }
    if not args.skip_compile:
        systems["torch.compile(TP(m), backend=keraunos)"] = lambda m: torch.compile(
            tp(m), backend="keraunos")
        systems["torch.compile(TP(m))"] = lambda m: torch.compile(tp(m))
    return systems


def _batches(rank: int, steps: int, seq: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, 512, (2, seq), generator=g),
             torch.randint(0, 512, (2, seq), generator=g)) for _ in range(steps)]


def _one_step(model, opt, idx, targets):
    opt.zero_grad(set_to_none=True)
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    opt.step()
    return loss.detach()


def _time_systems(systems, args, rank, same_batches=False):
    """Per system: step times (rank 0's clock, after a barrier per step), first step, losses.
    ``same_batches``: every rank trains on rank 0's batches (tensor parallel)."""
    built = {}
    for name, wrap in systems.items():
        try:
            model = wrap(make_model(args.layers, args.width))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            batches = _batches(0 if same_batches else rank,
                               args.warmup + args.steps * args.rounds, 32)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                first_loss = _one_step(model, opt, *batches[0])
            built[name] = dict(model=model, opt=opt, batches=batches, first=time.perf_counter() - start,
                               losses=[first_loss], times=[], error=None)
        except Exception as e:  # noqa: BLE001 - a refusal is a result
            built[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
        dist.barrier()
    position = 1
    for _ in range(args.warmup - 1):
        for b in built.values():
            if b["error"] is None:
                b["losses"].append(_one_step(b["model"], b["opt"], *b["batches"][position]))
        position += 1
    for _ in range(args.rounds):
        for b in built.values():
            if b["error"] is not None:
                continue
            for i in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                b["losses"].append(_one_step(b["model"], b["opt"], *b["batches"][position + i]))
                dist.barrier()
                b["times"].append(time.perf_counter() - t0)
        position += args.steps
    return built


def _report(title, built, rank, tables=None):
    """Prints the table (rank 0); with ``tables``, also appends it there as
    benchmarks/report.py renders it."""
    if rank != 0:
        return
    eager = next(iter(built.values()))
    base = statistics.median(eager["times"]) if eager["error"] is None else None
    rows = []
    print(f"\n{title}")
    print(f"  {'system':40s} {'step (median)':>14s} {'vs eager':>9s} {'first step':>11s}  losses")
    for name, b in built.items():
        if b["error"] is not None:
            print(f"  {name:40s} refused or failed: {b['error']}")
            rows.append([name, "refused or failed", "-", "-", b["error"]])
            continue
        med = statistics.median(b["times"])
        same = all(torch.allclose(a, e, rtol=1e-4, atol=1e-5)
                   for a, e in zip(b["losses"], eager["losses"]))
        ratio = f"{med / base:8.2f}x" if base else "        -"
        print(f"  {name:40s} {med * 1e3:11.2f} ms {ratio} {b['first']:9.2f} s  "
              f"{'as eager' if same else 'DIFFER'}")
        rows.append([name, f"{med * 1e3:.2f} ms", ratio.strip(), f"{b['first']:.2f} s",
                     "as eager" if same else "DIFFER"])
    if tables is not None:
        tables.append({"caption": title, "columns": ["system", "step (median)", "vs eager",
                                                     "first step", "losses"],
                       "rows": rows, "ratios_to": "eager"})


def _rank_main(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # compiles on busy machines
    sections = set(args.sections.split(","))
    tables = []
    try:
        if "ddp" in sections:
            _report("DDP training step, 2 gloo ranks",
                    _time_systems(_ddp_systems(args), args, rank), rank, tables)
        if "fsdp" in sections:
            from torch.distributed.device_mesh import init_device_mesh
            init_device_mesh("cpu", (world,))
            _report("FSDP2 training step, 2 gloo ranks",
                    _time_systems(_fsdp_systems(args), args, rank), rank, tables)
        if "tp" in sections:
            _report("Tensor parallel training step (MLPs column- then row-wise), 2 gloo ranks",
                    _time_systems(_tp_systems(args), args, rank, same_batches=True), rank,
                    tables)
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"tables": tables}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's, 25 MiB after a 1 MiB first)")
    parser.add_argument("--sections", default="ddp,fsdp,tp",
                        help="which of ddp, fsdp, tp to run (comma-separated)")
    parser.add_argument("--json", default="", help="also write the tables to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 1 step after 1 warm-up step: proves every path runs, "
                        "measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.warmup = 1, 1, 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
