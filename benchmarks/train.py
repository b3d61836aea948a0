"""A training step (forward, backward, AdamW step) on a litgpt GPT: eager vs keraunos vs torch.compile.

Run: python benchmarks/train.py [--iters N] [--layers L] [--width W] [--skip-compile]
                                [--compile-optimizer] [--optimizer-only] [--whole-step]
                                [--scheduler]

--compile-optimizer compiles the AdamW step too, on both sides: ``keraunos.jit(optimizer.step)``
against ``torch.compile(optimizer.step)`` (the recipe of torch's tutorial "Compiling the
optimizer"); without it the optimizer runs eagerly on every side. --optimizer-only times the
AdamW step alone (and ``AdamW(fused=True)``, torch's own fused CPU kernel, for reference). Regional compilation
(``block.compile()`` for each layer) is a system of its own. --whole-step adds
``keraunos.jit(train_step)``: zero_grad, forward, loss, backward and the AdamW step captured as one
program (``keraunos step``, and ``keraunos step fused``), beside torch's best recipes:
``torch.compile(model)`` with ``torch.compile(optimizer.step)``, and with ``AdamW(fused=True)``;
and the rows ``..., cosine lr``, whose step also steps a ``CosineAnnealingLR`` after the optimizer
(a float rate that changes on every step, the recipe most training runs). --scheduler steps it
on every system.

All figures from this one run, one intra-op thread:
- compile + warm-up time by the 2N method: time 2N steps; compile ~ sum(first N) - sum(last N);
- steady-state median step time (of the last N steps);
- each system's median step with all systems taking steps in turns (interleaved);
- bytes saved for backward by one forward, counted with torch.autograd.graph.saved_tensors_hooks
  (unique storages, so a tensor saved twice counts once), for eager and keraunos;
- peak memory of one step: the most bytes its tensors held at once beyond what was held when it
  started, from the profiler's allocation records (``profile_memory=True``) of the second of two
  steps, so that the frees of the gradients the first step made count.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import keraunos
from keraunos.testing.memory import peak_bytes

# benchmarks/fusion.py (keraunos bench) loads this file by its path: its folder is not on sys.path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from turns import medians_in_turns  # noqa: E402


def make_model(layers: int, width: int):
    import litgpt
    from litgpt.model import GPT
    config = litgpt.Config.from_name("Llama-2-7b-hf", n_layer=layers, n_embd=width,
                                     n_head=max(width // 64, 1), n_query_groups=max(width // 64, 1),
                                     intermediate_size=width * 4, padded_vocab_size=512,
                                     vocab_size=512, block_size=128)
    torch.manual_seed(0)
    return GPT(config)


def step_fn(model, optimizer, idx, targets, optimizer_step=None, scheduler=None):
    optimizer_step = optimizer_step or optimizer.step

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        optimizer_step()
        if scheduler is not None:
            scheduler.step()
        return loss
    return step


def regional(model):
    for block in model.transformer.h:
        block.compile()
    return model


def time_2n(step, n: int):
    times = []
    for _ in range(2 * n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    compile_and_warmup = sum(times[:n]) - sum(times[n:])
    return compile_and_warmup, statistics.median(times[n:]), times[0]


def optimizer_only(base, idx, targets, rounds: int) -> None:
    """The AdamW step alone, on gradients of one backward, every system in turns."""
    steps = {}
    for name, wrap, options in (
            ("eager", lambda s: s, {}),
            ("keraunos", lambda s: keraunos.jit(s, fuse="off"), {}),
            ("keraunos fused", lambda s: keraunos.jit(s, fuse="wait"), {}),
            ("torch.compile", torch.compile, {}),
            ("AdamW(fused=True)", lambda s: s, {"fused": True})):
        model = copy.deepcopy(base)
        logits = model(idx)
        F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)
        steps[name] = wrap(optimizer.step)
        for _ in range(3):  # the state, the capture, the fused compile
            steps[name]()
    medians = medians_in_turns(steps, rounds)
    print(f"  AdamW step alone, interleaved ({rounds} rounds), median: " + ", ".join(
        f"{k} {v * 1e3:.2f} ms ({v / medians['eager']:.2f}x eager, "
        f"{v / medians['torch.compile']:.2f}x torch.compile)" for k, v in medians.items()))


def saved_bytes(model, idx) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx).sum()
    return sum(storages.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="N of the 2N method")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--compile-optimizer", action="store_true",
                        help="compile the optimizer step too (keraunos.jit / torch.compile)")
    parser.add_argument("--optimizer-only", action="store_true",
                        help="time the AdamW step alone (eager, keraunos, torch.compile, fused)")
    parser.add_argument("--whole-step", action="store_true",
                        help="add keraunos.jit(train_step), the whole step as one program, and "
                        "torch's best recipes (compiled AdamW, AdamW(fused=True))")
    parser.add_argument("--scheduler", action="store_true",
                        help="step a CosineAnnealingLR after the optimizer, on every system")
    parser.add_argument("--json", default="", help="also write the table to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="N = 2: proves every path runs, measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.iters = 2
    torch.set_num_threads(1)
    base = make_model(args.layers, args.width)
    idx = torch.randint(0, 512, (1, 64))
    targets = torch.randint(0, 512, (1, 64))
    if args.optimizer_only:
        print(f"torch {torch.__version__}, 1 thread; litgpt Llama-2 config, {args.layers} "
              f"layers, n_embd {args.width}")
        optimizer_only(base, idx, targets, args.iters)
        return
    # The torch executor, and the fused program waited for (the default compiles it in the
    # background: benchmarks/tiers.py measures that). Each recipe: how the model is wrapped,
    # the optimizer's options, how its step is wrapped, how the whole step function is.
    same = lambda x: x  # noqa: E731
    jit_off = lambda x: keraunos.jit(x, fuse="off")  # noqa: E731
    jit_wait = lambda x: keraunos.jit(x, fuse="wait")  # noqa: E731
    optimizer_wraps = {"keraunos": jit_off, "keraunos fused": jit_wait,
                       "torch.compile": torch.compile, "regional": torch.compile}
    recipes = {"eager": (same, {}, same, same),
               "keraunos": (jit_off, {}, same, same),
               "keraunos fused": (jit_wait, {}, same, same)}
    if not args.skip_compile:
        recipes["torch.compile"] = (torch.compile, {}, same, same)
        recipes["regional"] = (regional, {}, same, same)
    if args.compile_optimizer:
        recipes = {name: (model_wrap, options, optimizer_wraps.get(name, same), step_wrap)
                   for name, (model_wrap, options, _, step_wrap) in recipes.items()}
    if args.whole_step:
        # keraunos.jit(train_step): zero_grad, forward, loss, backward and AdamW as one program;
        # against the best torch recipes (the optimizer compiled too, or torch's fused kernel).
        recipes["keraunos step"] = (same, {}, same, jit_off)
        recipes["keraunos step fused"] = (same, {}, same, jit_wait)
        if not args.skip_compile:
            recipes["torch.compile, compiled AdamW"] = (torch.compile, {}, torch.compile, same)
            recipes["torch.compile, AdamW(fused=True)"] = (torch.compile, {"fused": True},
                                                           same, same)
        # The same with the learning rate a scheduler changes on every step (``cosine lr``).
        recipes["keraunos step fused, cosine lr"] = (same, {}, same, jit_wait)
        if not args.skip_compile:
            recipes["torch.compile, cosine lr"] = (torch.compile, {}, same, same)
            recipes["torch.compile, AdamW(fused=True), cosine lr"] = (
                torch.compile, {"fused": True}, same, same)
    results = {}
    losses = {}
    steps = {}
    peaks = {}
    for name, (model_wrap, options, optimizer_wrap, step_wrap) in recipes.items():
        model = copy.deepcopy(base)
        runner = model_wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **options)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000) \
            if args.scheduler or name.endswith("cosine lr") else None
        step = step_wrap(step_fn(runner, optimizer, idx, targets,
                                 optimizer_wrap(optimizer.step), scheduler))
        compile_time, median, first = time_2n(step, args.iters)
        losses[name] = step().item()
        steps[name] = step
        results[name] = (compile_time, median, first)
        peaks[name] = peak_bytes(step)
        if model_wrap is not torch.compile and model_wrap is not regional and \
                step_wrap is same:
            results[name] += (saved_bytes(runner, idx),)
    print(f"torch {torch.__version__}, 1 thread; litgpt Llama-2 config, {args.layers} layers, "
          f"n_embd {args.width}, batch 1x64; AdamW "
          f"({'compiled' if args.compile_optimizer else 'eager'})"
          f"{', CosineAnnealingLR' if args.scheduler else ''}; 2N method with N = {args.iters}")
    eager = results["eager"]
    print(f"  {'system':<32} {'compile+warmup':>15} {'step (median)':>15} {'vs eager':>9} "
          f"{'saved for bw':>14} {'vs eager':>9}")
    for name, r in results.items():
        saved = f"{r[3] / 2**20:10.2f} MiB" if len(r) > 3 else f"{'n/a':>14}"
        saved_ratio = f"{r[3] / eager[3]:8.2f}x" if len(r) > 3 else f"{'':>9}"
        print(f"  {name:<32} {r[0]:13.3f} s {r[1] * 1e3:12.2f} ms {r[1] / eager[1]:8.2f}x "
              f"{saved} {saved_ratio}")
    interleaved = medians_in_turns(steps, args.iters)
    base_name = "torch.compile" if "torch.compile" in interleaved else "eager"
    print(f"  interleaved (every system's steps in turns, {args.iters} rounds, after the above), "
          f"median step: " + ", ".join(
              f"{k} {v * 1e3:.2f} ms ({v / interleaved[base_name]:.2f}x {base_name})"
              for k, v in interleaved.items()))
    if "torch.compile" in results:
        print(f"  compile+warmup, keraunos / torch.compile: "
              f"{results['keraunos'][0] / results['torch.compile'][0]:.3f}")
    print(f"  loss after {2 * args.iters + 1} steps: " +
          ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
    print("  peak memory of one step (tensors held at once beyond the step's start): " +
          ", ".join(f"{k} {v / 2**20:.2f} MiB ({v / peaks['eager']:.2f}x eager)"
                    for k, v in peaks.items()))
    if args.json:
        write_json(results, interleaved, base_name, losses, peaks, args.json)


def write_json(results: dict, interleaved: dict, base_name: str, losses: dict, peaks: dict,
               path: str) -> None:
    """The table as benchmarks/report.py renders it: one row per system."""
    eager = results["eager"]
    rows = [[name, f"{r[0]:.2f} s", f"{interleaved[name] * 1e3:.2f} ms",
             f"{interleaved[name] / interleaved[base_name]:.2f}x",
             f"{r[3] / 2**20:.2f} MiB ({r[3] / eager[3]:.2f}x)" if len(r) > 3 else "n/a",
             f"{peaks[name] / 2**20:.2f} MiB ({peaks[name] / peaks['eager']:.2f}x)",
             f"{losses[name]:.5f}"] for name, r in results.items()]
    with open(path, "w") as f:
        json.dump({"tables": [{"columns": ["system", "compile + warm-up", "step, in turns",
                                           f"vs {base_name}", "saved for backward (vs eager)",
                                           "peak memory of a step (vs eager)",
                                           "loss after the steps"],
                               "rows": rows, "ratios_to": base_name}]}, f, indent=1)


if __name__ == "__main__":
    main()
