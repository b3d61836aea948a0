"""The model zoo: compile and per-call time of inference and a training step, per system.

Run: python benchmarks/models.py [--models llama,bert] [--iters N] [--no-inductor] [--no-train]
     [--systems fused,inductor]

Every figure comes from this one run, one intra-op thread. Per zoo model (tiny configs, random
weights, nothing downloaded) and per system (eager, keraunos.jit, torch.compile with
backend="keraunos", the same backend with the inductor fusion executor
(``keraunos.dynamo.backend(executors=["inductor", "torch"])``), torch.compile with backend="eager"
(dynamo's own floor: its guards and frame evaluation around the uncompiled FX graphs),
torch.compile with Inductor):

- inference: eval mode, torch.no_grad(), with the zoo's padding mask where the model takes one;
- training step: train mode (the config's dropout), labels, no mask: ``zero_grad``, forward,
  ``loss.backward()``, ``AdamW.step()``, under one ``torch.manual_seed`` per system.

Columns: ``compile`` is the wall time of the first call (capture and compilation, plus one run);
``per call`` the median of ``--iters`` calls after it and two warm-up calls, and its ratio to
eager's and to Inductor's (the target for the backend with fusion: within 1.1x of Inductor). The
systems of one model and mode are all built first and then timed **in turns**, a few calls of
each per round (the order rotating each round; the first call of each turn, on the caches another
system left, is not counted), so that a change in the machine's load falls on every system alike
instead of on whichever was timed during it; ``paired`` the median over rounds of each round's
turn against Inductor's turn of the same round (a load change between rounds cancels out);
``min`` the fastest of those calls and its ratio to Inductor's fastest (on a shared machine the
median moves with the load; the minimum, what a call costs uncontended, moves much less);
``result`` is ``pass`` when the first call's outputs (and, for training, the loss and every
parameter's gradient) equal eager's within rtol/atol 1e-4, else ``FAIL`` with why: the
exception's type, or ``mismatch``. A failure never stops the script.
Inductor runs with ``torch._inductor.config.fallback_random = True``, so that its dropout draws
eager's random numbers and a training step can be compared.
"""
from __future__ import annotations

import argparse
import json
import copy
import importlib
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch the network

import torch  # noqa: E402

import keraunos  # noqa: E402
import keraunos.dynamo  # noqa: E402,F401 - registers backend="keraunos" without the entry point
from keraunos.testing.zoo import ZOO, inputs_of, make_models  # noqa: E402

TOLERANCE = dict(rtol=1e-4, atol=1e-4)


@dataclass
class Measured:
    """One system on one model and mode: first-call time, per-call median, and the verdict."""
    compile_s: float | None = None
    per_call_s: float | None = None
    min_s: float | None = None
    paired: float | None = None  # median over rounds of (this turn / Inductor's turn)
    error: str | None = None  # None: equals eager


def wrap_eager(model):
    return model


def wrap_jit(model):
    return keraunos.jit(model, fuse="off")


def wrap_backend(model):
    return torch.compile(model, backend=keraunos.dynamo.backend(fuse="off"))


def wrap_backend_fused(model):
    return torch.compile(model, backend=keraunos.dynamo.backend(executors=["inductor", "torch"], fuse="wait"))


def wrap_dynamo_floor(model):
    return torch.compile(model, backend="eager")


def wrap_inductor(model):
    return torch.compile(model)


SYSTEMS: dict[str, Callable] = {
    "eager": wrap_eager,
    "keraunos.jit": wrap_jit,
    "torch.compile(backend=keraunos)": wrap_backend,
    "backend=keraunos, inductor fusion": wrap_backend_fused,
    "torch.compile(backend=eager)": wrap_dynamo_floor,
    "torch.compile (Inductor)": wrap_inductor,
}
INDUCTOR = "torch.compile (Inductor)"
# --systems: short names of the systems above, in order
SHORT = dict(zip(("eager", "jit", "backend", "fused", "dynamo-eager", "inductor"), SYSTEMS))


# ------------------------------------------------------------------------------ comparison
def tensor_leaves(value) -> list[torch.Tensor]:
    """The tensors of a ModelOutput, tuple or list, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):  # a transformers ModelOutput
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensor_leaves(v)]
    return []


def same_tensors(got: list, want: list) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if (g is None) != (w is None):
            return False
        if g is not None:
            try:
                torch.testing.assert_close(g.detach(), w.detach(), **TOLERANCE)
            except AssertionError:
                return False
    return True


# ------------------------------------------------------------------------------- the modes
def timed_first_call(call: Callable):
    t0 = time.perf_counter()
    result = call()
    return result, time.perf_counter() - t0


def inference(base, name: str, wrap: Callable):
    """(the outputs' tensors, first-call seconds, a warm call) in eval mode under no_grad."""
    model = copy.deepcopy(base).eval()
    kwargs = inputs_of(name, seed=1, mask=True, labels=False)
    runner = wrap(model)

    def call():
        with torch.no_grad():
            return runner(**kwargs)

    out, first = timed_first_call(call)
    return tensor_leaves(out), first, call


def training(base, name: str, wrap: Callable):
    """(the first step's loss and gradients, first-step seconds, a warm step)."""
    model = copy.deepcopy(base).train()
    kwargs = inputs_of(name, seed=3, mask=False, labels=True)
    runner = wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = runner(**kwargs).loss
        loss.backward()
        optimizer.step()
        return loss

    torch.manual_seed(10)  # every system draws the same dropout masks in its first step
    loss, first = timed_first_call(step)
    observed = [loss] + [p.grad for p in model.parameters()]
    return observed, first, step


BATCH = 5  # calls of one system in a row, in turns with the others


def in_turns(calls: dict[str, Callable], iters: int,
             reference: str | None = None) -> dict[str, tuple[float, float, float | None] | str]:
    """Per system, (median, minimum, paired ratio) of the seconds a call takes, or the name of
    the exception a call raised.

    Two warm-up calls each, then rounds in which every system makes ``BATCH`` calls in a row,
    the first system of a round moving one place each round, until each has ``iters`` timed
    calls. The first call of each batch is not counted: it runs on the caches the previous
    system left (what one call in a loop of calls of the same model does not see), and that
    costs a system with more Python objects on its path more than one with fewer. The paired
    ratio compares each round's turn with ``reference``'s turn of the same round (the median
    call of each) and takes the median over rounds: a change of the machine's load between
    rounds, which moves both turns of a round alike, leaves it alone."""
    samples: dict[str, list[float]] = {label: [] for label in calls}
    turns: dict[str, list[float]] = {label: [] for label in calls}
    failed: dict[str, str] = {}

    def timed(label: str) -> float:
        t0 = time.perf_counter()
        try:
            calls[label]()
        except Exception as error:  # noqa: BLE001 - a failure is a row, never a crash
            failed[label] = f"timing: {type(error).__name__}"
        return time.perf_counter() - t0

    for label in calls:
        for _ in range(2):
            timed(label)
    labels = list(calls)
    for round_ in range(-(-iters // (BATCH - 1))):
        for k in range(len(labels)):
            label = labels[(round_ + k) % len(labels)]
            if label in failed:
                continue
            times = [timed(label) for _ in range(BATCH)]
            samples[label].extend(times[1:])
            turns[label].append(statistics.median(times[1:]))
    result: dict[str, tuple[float, float, float | None] | str] = {}
    for label, s in samples.items():
        if label in failed:
            result[label] = failed[label]
            continue
        paired = None
        if reference in turns and reference not in failed and turns[reference]:
            paired = statistics.median(a / b for a, b in zip(turns[label], turns[reference]))
        result[label] = (statistics.median(s[:iters]), min(s[:iters]), paired)
    return result


def measure(mode: Callable, base, name: str, systems: dict, iters: int,
            timed: set[str] | None = None) -> dict[str, Measured]:
    # One dynamo reset per model and mode: the systems built below stay alive together (dynamo
    # keeps one cache entry per backend, told apart by its backend-match check).
    torch._dynamo.reset()
    results: dict[str, Measured] = {}
    calls: dict[str, Callable] = {}
    reference = None
    for label, wrap in systems.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fallback notes; the verdict says what counts
                observed, first, call = mode(base, name, wrap)
        except Exception as error:  # noqa: BLE001 - a failure is a row, never a crash
            results[label] = Measured(error=type(error).__name__)
            continue
        if label == "eager":  # it runs first
            reference = observed
        if reference is None:
            verdict = "eager failed"
        else:
            verdict = None if same_tensors(observed, reference) else "mismatch"
        results[label] = Measured(first, error=verdict)
        if timed is None or label in timed:
            calls[label] = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timings = in_turns(calls, iters, INDUCTOR)
    for label, timing in timings.items():
        if isinstance(timing, str):
            results[label].error = results[label].error or timing
        else:
            results[label].per_call_s, results[label].min_s, results[label].paired = timing
    return results


# ----------------------------------------------------------------------------------- output
def print_table(title: str, rows: dict[str, dict[str, Measured]]) -> None:
    print(f"\n{title}", flush=True)
    print(f"  {'model':<11} {'system':<34} {'compile':>10} {'per call':>11} {'vs eager':>9}"
          f" {'vs Inductor':>11} {'paired':>8} {'min':>11} {'min vs Ind.':>11}  result")
    for model_name, results in rows.items():
        eager, inductor = results.get("eager"), results.get(INDUCTOR)
        for label, m in results.items():
            compile_s = f"{m.compile_s:8.3f} s" if m.compile_s is not None else f"{'':>10}"
            per_call = f"{m.per_call_s * 1e3:8.3f} ms" if m.per_call_s is not None else ""
            fastest = f"{m.min_s * 1e3:8.3f} ms" if m.min_s is not None else ""
            verdict = "pass" if m.error is None else f"FAIL ({m.error})"
            paired = f"{m.paired:7.2f}x" if m.paired is not None else ""
            print(f"  {model_name:<11} {label:<34} {compile_s:>10} {per_call:>11} "
                  f"{ratio(m, eager):>9} {ratio(m, inductor):>11} {paired:>8} {fastest:>11} "
                  f"{ratio(m, inductor, 'min_s'):>11}  {verdict}", flush=True)


def ratio(m: Measured, base: Measured | None, field: str = "per_call_s") -> str:
    mine, theirs = getattr(m, field), getattr(base, field, None)
    if mine is None or not theirs:
        return ""
    return f"{mine / theirs:8.2f}x"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(ZOO),
                        help=f"comma-separated zoo names (default: all {len(ZOO)})")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per system and mode")
    parser.add_argument("--no-inductor", action="store_true",
                        help="leave Inductor out (torch.compile's default and keraunos's fusion "
                             "executor): their compiles are slow")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a training step (default: on)")
    parser.add_argument("--systems", default=",".join(SHORT),
                        help=f"comma-separated, of {list(SHORT)} (default: all); results are "
                             f"compared with eager's outputs, so eager always runs, untimed "
                             f"unless listed")
    parser.add_argument("--json", default="", help="also write both tables to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="3 timed calls, llama alone unless --models says otherwise: "
                        "proves every path runs, measures nothing")
    args = parser.parse_args()
    if args.quick:  # one model unless --models names others
        args.iters = 3
        if args.models == ",".join(ZOO):
            args.models = "llama"
    args.systems = [x for x in args.systems.split(",") if x]
    unknown = [x for x in args.systems if x not in SHORT]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(SHORT)}")
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {list(ZOO)}")
    return args


def main():
    args = parse_args()
    torch.set_num_threads(1)
    # Four dynamo systems of one model live together, each with cache entries of its own for the
    # same frames: room for them all under dynamo's per-frame recompile limit.
    torch._dynamo.config.recompile_limit = 64
    systems = {label: wrap for label, wrap in SYSTEMS.items()
               if label == "eager" or label in {SHORT[x] for x in args.systems}}
    if args.no_inductor:
        systems.pop(INDUCTOR, None), systems.pop("backend=keraunos, inductor fusion", None)
    else:
        importlib.import_module("torch._inductor.config").fallback_random = True
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, keraunos "
          f"{keraunos.__version__}, 1 thread, {args.iters} timed calls per cell")
    inference_rows, training_rows = {}, {}
    for name in args.models:
        base, _ = make_models(name)
        timed = {SHORT[x] for x in args.systems}
        inference_rows[name] = measure(inference, base, name, systems, args.iters, timed)
        if args.train and ZOO[name].trains:
            training_rows[name] = measure(training, base, name, systems, args.iters, timed)
        # Each model's rows as soon as it is done (a run stopped early keeps what it measured);
        # the tables below gather them.
        print_table(f"done: {name}, inference", {name: inference_rows[name]})
        if name in training_rows:
            print_table(f"done: {name}, training step", {name: training_rows[name]})
    print_table("inference (eval, no_grad, padding mask where taken)", inference_rows)
    if args.train:
        print_table("training step (zero_grad, forward, loss.backward(), AdamW.step(); train mode, "
                    "labels)", training_rows)
    if args.json:
        write_json({"inference": inference_rows, "training step": training_rows}, args.json)


def write_json(tables: dict[str, dict[str, dict[str, Measured]]], path: str) -> None:
    """Both tables as benchmarks/report.py renders them: one row per model, one column per
    system, each cell the median per call and its ratio to Inductor's, paired round by round
    (the median of this system's turn over Inductor's turn of the same round; "FAIL (...)" where the
    result differs from eager's or the system failed)."""
    out = []
    for caption, rows in tables.items():
        if not rows:
            continue
        systems = list(next(iter(rows.values())))
        table_rows = []
        for model_name, results in rows.items():
            inductor = results.get(INDUCTOR)
            cells = [model_name]
            for label in systems:
                m = results.get(label)
                if m is None or m.error is not None or m.per_call_s is None:
                    cells.append(f"FAIL ({m.error})" if m is not None and m.error else "-")
                    continue
                base = getattr(inductor, "per_call_s", None)
                ratio = m.paired if m.paired is not None else (m.per_call_s / base
                                                                if base else None)
                cells.append(f"{m.per_call_s * 1e3:.3f} ms"
                             + (f" ({ratio:.2f}x)" if ratio is not None else ""))
            table_rows.append(cells)
        out.append({"caption": caption, "columns": ["model"] + systems, "rows": table_rows,
                    "ratios_to": INDUCTOR})
    with open(path, "w") as f:
        json.dump({"tables": out}, f, indent=1)


if __name__ == "__main__":
    main()
