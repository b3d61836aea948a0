"""Where one steady step of benchmarks/train.py goes: keraunos fused against torch.compile, and the
floor that any compiler of the model's forward and backward pays when AdamW runs eagerly.

Run: python benchmarks/step_account.py [--rounds N] [--repeats R] [--floor] [--compile-optimizer]
     [--whole-step]

Default (the account): both systems (and eager with --eager) are compiled and warmed in one
process, then take profiled steps in turns (``torch.profiler``, CPU); each event's self time is
put in one category (matrix products, attention, Inductor's C++ kernels, copies, the loss, the
optimizer, the wrappers' and autograd's own Python, ...), and the table gives each category's
median over the profiled steps, in ms. Inductor's kernels appear by name only when compiled with
``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``, which this script sets before Inductor is imported
(the setting is part of Inductor's cache key: these kernels are compiled apart from the usual
ones). The profiler inflates whatever makes many small calls (the eager AdamW: ~300 ATen calls);
the last row is the median step without it, in turns, to read the rest against.

--floor: the step's library calls that every side makes as they are, timed alone in turns with
both systems' steps (no profiler): the step's ``aten::mm`` calls with the shapes and strides of
torch.compile's step (read from one profiled step of it), its flash-attention kernels forward and
backward, the loss (``cross_entropy``, eager on every side), ``zero_grad`` and the eager AdamW
step. Their sum is a lower bound on any step with the same BLAS and the eager optimizer; against
0.9x torch.compile's step it says how much room such a target leaves. With
--compile-optimizer both sides compile AdamW's step (as ``train.py --compile-optimizer``), and the
floor's optimizer step is torch.compile's.

--whole-step: the systems are ``keraunos.jit(train_step)`` fused (forward, loss, backward and
AdamW as one program) and the best torch recipe of ``train.py --whole-step``,
``torch.compile(model)`` with ``AdamW(fused=True)``; with --floor, the floor is the library calls
both make (matrix products, attention, the loss) and torch's fused AdamW kernel, the fastest
update measured here, and the ratios are to that recipe's step.
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import tempfile
import time

if "--floor" not in sys.argv:  # (read before Inductor's config is imported)
    os.environ.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keraunos  # noqa: E402
from train import make_model, step_fn  # noqa: E402
from turns import samples_in_turns  # noqa: E402

VOCAB = 512
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
LOSS = ("aten::_log_softmax", "aten::nll_loss_forward", "aten::_log_softmax_backward_data",
        "aten::nll_loss_backward")
WRAPPERS = ("KeraunosFunction", "KeraunosFunctionBackward", "CompiledFunction",
            "CompiledFunctionBackward", "TorchDynamo Cache Lookup")


def category(name: str, in_optimizer: bool, backward: bool) -> str:
    """The row an event's self time goes to."""
    side = "backward" if backward else "forward"
    if in_optimizer:
        return "optimizer: eager AdamW, everything under its step"
    if name.startswith("Optimizer.zero_grad"):
        return "zero_grad"
    if name in ("aten::mm", "aten::addmm", "aten::bmm"):
        return f"matrix products (aten::mm), {side}"
    if name in ATTENTION:
        return f"flash attention, {side}"
    if name.startswith("graph_") and "cpp_fused" in name:
        return f"Inductor's C++ kernels, {side}"
    if name in LOSS:
        return "loss kernels (eager on both sides)"
    if name in ("aten::embedding_dense_backward", "aten::index_select", "aten::index_add_"):
        return "embedding (outside regions in keraunos)"
    if name in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"):
        return f"copies, {side}"
    if name in ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_",
                "aten::fill_", "aten::resize_"):
        return f"allocation and zeroing, {side}"
    if name.startswith("aten::"):
        return f"other ATen calls (views, ...), {side}"
    if name.startswith("autograd::engine") or name == "torch::autograd::AccumulateGrad":
        return "autograd engine (node dispatch, AccumulateGrad)"
    if name in WRAPPERS or name.startswith(("Torch-Compiled Region", "## Call CompiledFxGraph")):
        return f"wrappers' own Python (Function, generated code), {side}"
    return f"other, {side}"


def account(prof) -> collections.Counter:
    rows: collections.Counter = collections.Counter()
    for ev in prof.events():
        in_optimizer = ev.name.startswith("Optimizer.step")
        backward = "Backward" in ev.name or ev.name.startswith("autograd::engine")
        parent = ev.cpu_parent
        while parent is not None:
            in_optimizer = in_optimizer or parent.name.startswith("Optimizer.step")
            backward = backward or parent.name.startswith("autograd::engine")
            parent = parent.cpu_parent
        rows[category(ev.name, in_optimizer, backward)] += ev.self_cpu_time_total / 1e3
    return rows


BEST_TORCH = "torch.compile, AdamW(fused=True)"


def whole_steps(base, idx, targets) -> dict:
    """``keraunos.jit(train_step)`` fused, and torch.compile's model with the fused AdamW."""
    steps = {}
    for name in ("keraunos step fused", BEST_TORCH):
        model = copy.deepcopy(base)
        if name == BEST_TORCH:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            steps[name] = step_fn(torch.compile(model), optimizer, idx, targets)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            steps[name] = keraunos.jit(step_fn(model, optimizer, idx, targets), fuse="wait")
        for _ in range(5):
            steps[name]()
    return steps


def make_steps(base, idx, targets, eager: bool, compile_optimizer: bool) -> dict:
    """Each system's step; with ``compile_optimizer``, each compiles AdamW's step as well."""
    def fused(fn):
        return keraunos.jit(fn, fuse="wait")
    systems = {"keraunos fused": fused, "torch.compile": torch.compile}
    if eager:
        systems = {"eager": lambda fn: fn, **systems}
    steps = {}
    for name, wrap in systems.items():
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps[name] = step_fn(wrap(model), optimizer, idx, targets,
                              wrap(optimizer.step) if compile_optimizer else None)
        for _ in range(5):  # the compile, the optimizer's state, the first calls' checks
            steps[name]()
    return steps


def print_account(steps: dict, rounds: int) -> None:
    tables = {name: collections.defaultdict(list) for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                step()
                wall = (time.perf_counter() - t0) * 1e3
            rows = account(prof)
            rows["profiled step (wall)"] = wall
            rows["profiled wall less every event's self time"] = wall - sum(
                v for k, v in rows.items() if k != "profiled step (wall)")
            for k, v in rows.items():
                tables[name][k].append(v)
    plain = {k: statistics.median(v) for k, v in samples_in_turns(steps, rounds).items()}
    names = sorted({k for t in tables.values() for k in t}, key=lambda k: (
        k.startswith("profiled"), k))
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}; "
          f"median of {rounds} profiled steps each, in turns (ms per step)")
    print(f"| {'category':<58} | " + " | ".join(f"{n:>14}" for n in steps) + " |")
    print(f"|{'-' * 60}|" + "|".join("-" * 16 for _ in steps) + "|")
    for k in names:
        print(f"| {k:<58} | " + " | ".join(
            f"{statistics.median(tables[n][k]) if tables[n][k] else 0.0:14.3f}"
            for n in steps) + " |")
    print(f"| {'step without the profiler (median, in turns)':<58} | " + " | ".join(
        f"{plain[n] * 1e3:14.3f}" for n in steps) + " |")


def library_calls(step) -> list:
    """The step's aten::mm and flash-attention calls (not the optimizer's), as
    (name, input dims, input strides), in the order the step made them."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    optimizer = [(e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("name", "").startswith("Optimizer.step")]
    wanted = [e for e in events if e.get("ph") == "X" and e.get("name") in ("aten::mm", *ATTENTION)
              and not any(a <= e["ts"] <= b for a, b in optimizer)]
    return [(e["name"], e["args"]["Input Dims"], e["args"]["Input Strides"])
            for e in sorted(wanted, key=lambda e: e["ts"])]


def replayed(calls: list) -> dict:
    """One function per kind of library call that makes every such call of the step, on tensors
    of the recorded shapes and strides (the attention backward's on a real forward's output)."""
    def made(dims, strides):
        return torch.empty_strided(dims, strides).normal_()
    forward, backward = (getattr(torch.ops.aten, n.split("::")[1]).default for n in ATTENTION)
    mms, attention = [], []
    for name, dims, strides in calls:
        if name == "aten::mm":
            a, b = made(dims[0], strides[0]), made(dims[1], strides[1])
            mms.append(lambda a=a, b=b, d=dims[2], s=strides[2]:
                       torch.mm(a, b, out=torch.empty_strided(d, s)))
        elif name == ATTENTION[0]:
            q, k, v = (made(d, s) for d, s in zip(dims[:3], strides[:3]))
            attention.append(lambda q=q, k=k, v=v: forward(q, k, v, 0.0, True, scale=0.125))
        else:
            grad, q, k, v = (made(d, s) for d, s in zip(dims[:4], strides[:4]))
            out, lse = forward(q, k, v, 0.0, True, scale=0.125)
            out = torch.empty_strided(dims[4], strides[4]).copy_(out)
            lse = torch.empty_strided(dims[5], strides[5]).copy_(lse)
            attention.append(lambda g=grad, q=q, k=k, v=v, o=out, lse=lse:
                             backward(g, q, k, v, o, lse, 0.0, True, scale=0.125))

    def run(fns):
        def go():
            for fn in fns:
                fn()
        return go
    return {f"matrix products ({len(mms)} aten::mm)": run(mms),
            f"flash attention ({len(attention)} calls)": run(attention)}


def print_floor(base, idx, targets, steps: dict, rounds: int, repeats: int,
                compile_optimizer: bool, whole_step: bool = False) -> None:
    reference = BEST_TORCH if whole_step else "torch.compile"
    parts = replayed(library_calls(steps[reference]))
    model = copy.deepcopy(base)  # AdamW on a copy of its own, with one backward's gradients
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3,
                                  **({"fused": True} if whole_step else {}))
    logits = model(idx)
    F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)).backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    logits = logits.detach().clone().requires_grad_()

    def loss():
        logits.grad = None
        F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)).backward()

    def zero_grad():  # as the step does it; the gradients go back for the next AdamW step
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
    adamw = torch.compile(optimizer.step) if compile_optimizer else optimizer.step
    for _ in range(3):
        adamw()
    if whole_step:  # (the whole step's zero_grad lets go of the gradients: nothing to time)
        parts.update({"loss (cross_entropy forward and backward)": loss,
                      "AdamW(fused=True) step": adamw})
    else:
        parts.update({"loss (cross_entropy forward and backward)": loss, "zero_grad": zero_grad,
                      ("torch.compile'd" if compile_optimizer else "eager") + " AdamW step": adamw})

    def floor():
        for part in parts.values():
            part()
    calls = {**steps, "floor: all of the below": floor, **parts}
    for call in calls.values():
        call()
    for repeat in range(repeats):
        load = " ".join(open("/proc/loadavg").read().split()[:3])
        samples = samples_in_turns(calls, rounds)
        medians = {k: statistics.median(v) for k, v in samples.items()}
        compiled = medians[reference]
        per_round = statistics.median(
            f / c for f, c in zip(samples["floor: all of the below"], samples[reference]))
        print(f"run {repeat + 1}: load average {load}; {rounds} rounds in turns, medians")
        for k, v in medians.items():
            print(f"  {k:<44} {v * 1e3:8.2f} ms {v / compiled:7.3f}x {reference}'s step")
        print(f"  floor / {reference}'s step, median of the rounds' ratios: {per_round:.3f} "
              f"(the target, 0.9x, is {0.9 * compiled * 1e3:.2f} ms)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="--floor: runs of --rounds")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--eager", action="store_true", help="the account of eager's step too")
    parser.add_argument("--compile-optimizer", action="store_true",
                        help="both sides compile AdamW's step (the floor: torch.compile's)")
    parser.add_argument("--whole-step", action="store_true",
                        help="keraunos.jit(train_step) against torch.compile with "
                             "AdamW(fused=True)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = make_model(4, 256)
    idx = torch.randint(0, VOCAB, (1, 64))
    targets = torch.randint(0, VOCAB, (1, 64))
    if args.whole_step:
        steps = whole_steps(base, idx, targets)
        print(f"torch {torch.__version__}, 1 thread; benchmarks/train.py's model and step, "
              f"the whole step as one program against {BEST_TORCH}")
    else:
        steps = make_steps(base, idx, targets, args.eager and not args.floor,
                           args.compile_optimizer)
        print(f"torch {torch.__version__}, 1 thread; benchmarks/train.py's model and step (AdamW "
              f"{'compiled by each side' if args.compile_optimizer else 'eager on every side'})")
    if args.floor:
        print_floor(base, idx, targets, steps, args.rounds, args.repeats, args.compile_optimizer,
                    args.whole_step)
    else:
        print_account(steps, args.rounds)


if __name__ == "__main__":
    main()
