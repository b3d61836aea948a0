"""torchvision's image models: per call (eval, no_grad) and per training step (forward, a loss,
backward, an SGD step), eager vs keraunos's fused tier vs torch.compile, in one process, timed in
turns (one call of each system per round), so that a busy machine slows them alike.

Run: python benchmarks/vision.py [--models resnet18,mobilenet_v3_small,efficientnet_b0]
[--rounds N] [--batch B] [--size S] [--modes eval,train]

Random weights, a batch of ``--batch`` images of ``--size`` pixels, one intra-op thread. keraunos
runs with ``fuse="wait"`` (the program the default switches to once fused; benchmarks/tiers.py
times the switch). Prints each median and its ratio to torch.compile's. torchvision is imported
by ``keraunos.testing.vision.import_torchvision`` (docs/getting_started.md: how it is installed on these machines).

``--channels-last`` gives every system the model and the input in channels-last memory format
(``model.to(memory_format=torch.channels_last)``): then keraunos's regions need no layout
conversions at their borders, as torch.compile's single graph needs none.

``--profile N`` then runs N calls of each system under ``torch.profiler``, in turns (three
rounds, the first dropped), and prints each ATen op's self time per call for every system,
largest first: where keraunos's call and torch.compile's differ, op by op, in one process. The
fused kernels of keraunos's regions have no event of their own (called past Inductor's wrappers,
``executors/fusion/compiler.py``): in training they are in ``KeraunosFunction``'s and
``KeraunosFunctionBackward``'s self time, in eval in no row (the rows then sum to less than the
call).

``--region-layout-optimization off`` compiles every one of keraunos's regions with Inductor's
``layout_optimization`` off (torch.compile keeps its default, on); by default (``auto``) each
region's layout is keraunos's choice (``executors/fusion/channels_last.py``: off where a region's
convolutions are all dense, Inductor's channels-last elsewhere).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import keraunos
from keraunos.testing.vision import import_torchvision
from turns import samples_in_turns

SYSTEMS = ("eager", "keraunos", "torch.compile")


@contextlib.contextmanager
def _region_layout_optimization(off: bool):
    """Inductor's ``layout_optimization`` off while keraunos compiles its regions, if ``off``
    (``fuse="wait"`` compiles them in the first call, on this thread)."""
    if not off:
        yield
        return
    from torch._inductor import config
    with config.patch(layout_optimization=False):
        yield


def _caller(system: str, model: torch.nn.Module, x: torch.Tensor, train: bool):
    run = (model if system == "eager" else keraunos.jit(model, fuse="wait")
           if system == "keraunos" else torch.compile(model))
    if not train:
        def call():
            with torch.no_grad():
                return run(x)
        return call
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = run(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss
    return step


def measure(name: str, train: bool, rounds: int, x: torch.Tensor,
            regions_layout_off: bool = False, channels_last: bool = False,
            profile: int = 0) -> dict:
    torch.manual_seed(0)
    base = getattr(import_torchvision().models, name)()
    if channels_last:
        base = base.to(memory_format=torch.channels_last)
    calls = {}
    for system in SYSTEMS:
        call = _caller(system, copy.deepcopy(base).train(train), x, train)
        start = time.perf_counter()
        with _region_layout_optimization(regions_layout_off and system == "keraunos"):
            call()  # compiles
        print(f"  {name} {'train' if train else 'eval'}: {system} compiled in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        call()
        calls[system] = call
    samples = samples_in_turns(calls, rounds)
    if profile:
        _print_profile(f"{name} {'train' if train else 'eval'}", calls, profile)
    return {system: statistics.median(s) for system, s in samples.items()}


def _print_profile(title: str, calls: dict, count: int, rows: int = 25) -> None:
    """Each op's self CPU time per call under ``torch.profiler``, for every system: ``count``
    calls per system and round, in turns, three rounds with the first dropped (warm-up)."""
    from torch.profiler import ProfilerActivity, profile
    totals = {system: {} for system in calls}
    for round_ in range(3):
        for system, call in calls.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(count):
                    call()
            if round_ == 0:
                continue
            for event in prof.key_averages():
                spent, seen = totals[system].get(event.key, (0.0, 0))
                totals[system][event.key] = (spent + event.self_cpu_time_total, seen + event.count)
    per_call = 2 * count  # two rounds kept
    keys = sorted({k for t in totals.values() for k in t},
                  key=lambda k: -max(t.get(k, (0.0, 0))[0] for t in totals.values()))
    print(f"  profile, {title}: self CPU ms per call (op calls per call)")
    print("    " + f"{'op':<58}" + "".join(f"{system:>22}" for system in calls))
    for key in keys[:rows]:
        cells = []
        for t in totals.values():
            spent, seen = t.get(key, (0.0, 0))
            cells.append(f"{spent / 1e3 / per_call:12.3f} ({seen / per_call:6.1f})")
        print(f"    {key[:58]:<58}{''.join(cells)}")
    print("    " + f"{'all ops':<58}" + "".join(
        f"{sum(v[0] for v in t.values()) / 1e3 / per_call:12.3f}{'':10}" for t in totals.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mobilenet_v3_small,efficientnet_b0")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--region-layout-optimization", choices=("auto", "off"), default="auto",
                        help="Inductor's layout_optimization for keraunos's regions")
    parser.add_argument("--channels-last", action="store_true",
                        help="the model and the input in channels-last memory format")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N calls of each system, in turns: each op's self "
                             "time per call")
    parser.add_argument("--json", default="", help="also write the table to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds of resnet18 in eval: proves every path runs, measures "
                        "nothing")
    args = parser.parse_args()
    if args.quick:  # resnet18 in eval alone: the other models' compiles take minutes
        args.rounds, args.models, args.modes = 3, "resnet18", "eval"
    torch.set_num_threads(1)
    x = torch.randn(args.batch, 3, args.size, args.size)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    results = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            results.append((name, mode, measure(name, mode == "train", args.rounds, x,
                                                args.region_layout_optimization == "off",
                                                args.channels_last, args.profile)))
    print(f"torch {torch.__version__}, 1 thread, ({args.batch}, 3, {args.size}, {args.size}), "
          f"medians of {args.rounds} rounds in turns; ratios to torch.compile; regions' layout "
          f"optimization {args.region_layout_optimization}"
          f"{'; channels-last model and input' if args.channels_last else ''}")
    for name, mode, medians in results:
        base = medians["torch.compile"]
        print(f"  {name:<20} {mode:<6} " + "  ".join(
            f"{system} {t * 1e3:8.2f} ms ({t / base:.2f}x)" for system, t in medians.items()))
    if args.json:
        write_json(results, args.json)
    return 0


def write_json(results: list, path: str) -> None:
    """The table as benchmarks/report.py renders it: one row per model and mode, each cell the
    median and its ratio to torch.compile's."""
    import json
    systems = list(results[0][2])
    rows = [[f"{name} {mode}"] + [f"{medians[s] * 1e3:.2f} ms "
                                  f"({medians[s] / medians['torch.compile']:.2f}x)"
                                  for s in systems] for name, mode, medians in results]
    with open(path, "w") as f:
        json.dump({"tables": [{"caption": "torchvision, per call",
                               "columns": ["model"] + systems, "rows": rows,
                               "ratios_to": "torch.compile"}]}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
