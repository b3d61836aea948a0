"""Reduced precision on a litgpt GPT: a float32 model under bfloat16 autocast, and a bfloat16
model; eval forward and training step, eager vs keraunos vs torch.compile.

Run: python benchmarks/precision.py [--layers L] [--width W] [--batch B] [--seq T]
                                    [--rounds N] [--cases autocast-eval,autocast-step,...]
                                    [--json PATH] [--quick]

Cases: ``autocast-eval`` (float32 weights, ``torch.autocast("cpu", torch.bfloat16)``, under
``no_grad``), ``autocast-train`` (the same model in train mode: forward, loss in float32,
backward, AdamW step, the forward and loss under autocast as PyTorch's recipe has them),
``bf16-eval`` and ``bf16-train`` (the model cast to bfloat16, AdamW on its bfloat16 weights);
``autocast-step`` and ``bf16-step``, the training steps of the train cases with keraunos
compiling the whole step function as one program (``keraunos.jit(train_step)``: zero_grad,
forward, loss, backward, AdamW) where the train cases jit the model alone.
Systems: eager, ``keraunos.jit(model, fuse="wait")`` (its fused program, compiled before timing;
for a step case ``keraunos.jit(train_step, fuse="wait")``) and ``torch.compile(model)`` (with
eager AdamW, as in every training case). Every system takes one call per round, in turns, one intra-op
thread; the table gives each one's median and its ratio to eager and to torch.compile, and how
far each system is from a float64 run of the model (root mean square of the logits, or of every
gradient of one training step) against eager's distance. ``--json`` writes the table for
``benchmarks/report.py``; ``--quick`` runs every path on a tiny model.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

import keraunos

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from turns import medians_in_turns  # noqa: E402

CASES = ("autocast-eval", "autocast-train", "autocast-step", "bf16-eval", "bf16-train",
         "bf16-step")


def make_model(layers: int, width: int, vocab: int = 512):
    import litgpt
    from litgpt.model import GPT
    config = litgpt.Config.from_name("Llama-2-7b-hf", n_layer=layers, n_embd=width,
                                     n_head=max(width // 64, 1), n_query_groups=max(width // 64, 1),
                                     intermediate_size=width * 4, padded_vocab_size=vocab,
                                     vocab_size=vocab, block_size=256)
    torch.manual_seed(0)
    return GPT(config)


def _autocast(case: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.startswith("autocast") \
        else contextlib.nullcontext()


def train_step(model, optimizer, idx, targets, case: str, upcast=torch.float32):
    """The step function of the training cases: forward and loss under autocast where the case
    has it, the loss in ``upcast``, backward, AdamW."""
    def step():
        optimizer.zero_grad(set_to_none=True)
        with _autocast(case):
            logits = model(idx)
            loss = F.cross_entropy(logits.to(upcast).view(-1, logits.size(-1)),
                                   targets.view(-1))
        loss.backward()
        optimizer.step()
        return loss
    return step


def step_calls(case: str, base, idx, targets) -> dict:
    """name -> one training step: keraunos compiles the step function, torch.compile the model."""
    calls = {}
    for name in ("eager", "keraunos", "torch.compile"):
        model = copy.deepcopy(base).train()
        if case.startswith("bf16"):
            model = model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs = torch.compile(model) if name == "torch.compile" else model
        step = train_step(runs, optimizer, idx, targets, case)
        calls[name] = keraunos.jit(step, fuse="wait") if name == "keraunos" else step
        for _ in range(3):
            calls[name]()
    return calls


def step_numerics(case: str, base, idx, targets) -> dict:
    """Each system's distance from float64 of the gradients a step leaves, as ``numerics``:
    AdamW with a rate of 0 (the parameters stay), the second step's (keraunos's fused one)."""
    got = {}
    for name in ("float64", "eager", "keraunos", "torch.compile"):
        model = copy.deepcopy(base).train()
        if name == "float64":
            model = model.double()
        elif case.startswith("bf16"):
            model = model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        runs = torch.compile(model) if name == "torch.compile" else model
        step = train_step(runs, optimizer, idx, targets,
                          "exact" if name == "float64" else case,
                          torch.float64 if name == "float64" else torch.float32)
        step = keraunos.jit(step, fuse="wait") if name == "keraunos" else step
        for _ in range(2):
            step()
        got[name] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    exact = got.pop("float64")
    return {name: (v - exact).square().mean().sqrt().item() for name, v in got.items()}


def system_calls(case: str, base, idx, targets) -> dict:
    """name -> a call of one eval forward or one training step, warmed up and compiled."""
    if case.endswith("step"):
        return step_calls(case, base, idx, targets)
    training = case.endswith("train")
    calls = {}
    for name in ("eager", "keraunos", "torch.compile"):
        model = copy.deepcopy(base).train(training)
        if case.startswith("bf16"):
            model = model.to(torch.bfloat16)
        run = {"eager": model, "keraunos": keraunos.jit(model, fuse="wait"),
               "torch.compile": torch.compile(model)}[name]
        if training:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def call(run=run, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                with _autocast(case):
                    logits = run(idx)
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                           targets.view(-1))
                loss.backward()
                optimizer.step()
        else:
            def call(run=run):
                with torch.no_grad(), _autocast(case):
                    run(idx)
        for _ in range(3):  # compiles (keraunos: its fused program), then warms up
            call()
        calls[name] = call
    return calls


def numerics(case: str, base, idx, targets) -> dict:
    """Each system's distance from a float64 run of the same model (root mean square): of the
    logits for an eval case, of every gradient together for a training case (one step)."""
    if case.endswith("step"):
        return step_numerics(case, base, idx, targets)
    training = case.endswith("train")
    exact_model = copy.deepcopy(base).double().train(training)
    got = {}
    for name in ("float64", "eager", "keraunos", "torch.compile"):
        model = exact_model if name == "float64" else copy.deepcopy(base).train(training)
        if case.startswith("bf16") and name != "float64":
            model = model.to(torch.bfloat16)
        run = {"keraunos": lambda m: keraunos.jit(m, fuse="wait"),
               "torch.compile": torch.compile}.get(name, lambda m: m)(model)
        context = _autocast(case) if name != "float64" else contextlib.nullcontext()
        for _ in range(2):  # (keraunos's second call: its fused program, as the first's)
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(training), context:
                logits = run(idx)
                loss = F.cross_entropy(logits.double().view(-1, logits.size(-1)),
                                       targets.view(-1))
            if training:
                loss.backward()
        got[name] = torch.cat([p.grad.double().flatten() for p in model.parameters()]) \
            if training else logits.double()
    exact = got.pop("float64")
    return {name: (v - exact).square().mean().sqrt().item() for name, v in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="every path, nothing measured")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.rounds = 1, 64, 1
    torch.set_num_threads(1)
    base = make_model(args.layers, args.width)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 512, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, 512, (args.batch, args.seq), generator=g)
    print(f"litgpt GPT, {args.layers} layers, {args.width} wide, batch ({args.batch}, "
          f"{args.seq}), torch {torch.__version__}, one intra-op thread, {args.rounds} rounds "
          f"in turns; distance from float64: root mean square of the logits (eval) or of every "
          f"gradient of one step (train)")
    columns = ["case", "eager", "keraunos", "torch.compile", "keraunos / torch.compile",
               "keraunos / eager", "from float64, keraunos / eager"]
    rows = []
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for case in args.cases.split(","):
        distance = numerics(case, base, idx, targets)
        medians = medians_in_turns(system_calls(case, base, idx, targets), args.rounds)
        e, k, c = (medians[n] * 1e3 for n in ("eager", "keraunos", "torch.compile"))
        rows.append([case, f"{e:.1f} ms", f"{k:.1f} ms", f"{c:.1f} ms", f"{k / c:.2f}x",
                     f"{k / e:.2f}x", f"{distance['keraunos'] / distance['eager']:.2f}x "
                     f"(torch.compile {distance['torch.compile'] / distance['eager']:.2f}x)"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tables": [{"columns": columns, "rows": rows}]}, f, indent=1)


if __name__ == "__main__":
    main()
