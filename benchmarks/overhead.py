"""Per-call overhead of warm calls: eager, keraunos and torch.compile, in one run.

Run: python benchmarks/overhead.py [--calls N] [--skip-compile] [--only calls | --only prologue]
     [--programs decode,...] [--systems backend,inductor,...]

Every figure is measured in this one run, one intra-op thread (torch.set_num_threads(1)).
``--skip-compile`` leaves every torch.compile system out; ``--only`` runs one of the two parts.

Part "calls": per-call time of four programs under five systems. Every compiled system
must give eager's output once (torch.testing.assert_close) before it is timed (the keraunos
backend's background fusion is waited for, so the program it settles on is timed); then the systems
take turns, blocks of calls each, the order rotating every round, so a change of the machine's
load hits them alike; a system's figure is the median over its blocks of the time per call.
Programs (rows):
- ``tiny``: ``(x * 2 + 1).relu()``, x of shape (4,);
- ``mlp``: ``nn.Sequential(Linear(8, 16), ReLU(), Linear(16, 8))`` on (2, 8), under no_grad;
- ``mlp-grad``: the same MLP in grad mode (forward only, no backward);
- ``decode``: a decode step of litgpt's KV-cache GPT (2 layers, n_embd 64, random weights, as
  benchmarks/generate.py builds it) under inference_mode: one token at a position that moves
  each call, ``input_pos_maxp1`` left None so that every shape stays fixed (litgpt then masks
  the whole cache).
Systems (columns): ``eager``; ``keraunos.jit`` (``keraunos.jit(m, fuse="off")``); ``backend``
(``torch.compile(m, backend="keraunos")``); ``inductor`` (``torch.compile(m)``); ``dynamo``
(``torch.compile(m, backend="eager")``: Dynamo's own cost). Each cell is microseconds and the
ratio to eager; three ratios follow: keraunos.jit / eager, backend / inductor and
backend / keraunos.jit.

Part "prologue", two programs, medians over many calls:
- a tiny function, gelu(x @ y + 1).sum(-1) with x 4x8 and y 8x8: whole-call time; and its cache
  hit on a symbolic entry (dynamic=True) against a static one, prologue alone, computation alone
  and whole call, timed in turns;
- a Llama-3-8B-shaped litgpt GPT (all 32 layers and every parameter tensor of the real config,
  tiny widths), input (1, 8), under torch.no_grad(): the prologue alone (the cache-hit checks) and
  the whole call; plus a reference, a plain Python loop checking shape, dtype, device and
  requires_grad of the same tensors the prologue checks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch the network
# The keraunos of this checkout (a git worktree too), not whichever one is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import keraunos  # noqa: E402
from keraunos.runtime import native  # noqa: E402

native.LOADER.start(wait=True)  # keraunos.jit's native hit path, built first where it is not yet
from keraunos.transforms import ExtractionOnlyPrologueTransform  # noqa: E402


def median_time(fn, calls: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def tiny(x, y):
    return F.gelu(x @ y + 1).sum(-1)


def reference_check_loop(tensors, expected):
    """What checking every tensor one by one in Python costs."""
    def loop():
        for t, (shape, dtype, device, requires_grad) in zip(tensors, expected):
            if (t.shape != shape or t.dtype != dtype or t.device != device
                    or t.requires_grad != requires_grad):
                return False
        return True
    return loop


def dynamo_guard_check(compiled_fn, code, frame_locals):
    """A callable running torch.compile's guards for the cached frame, or None if unavailable."""
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        manager = entries[0].guard_manager
        if not manager.check(frame_locals):
            return None
        return lambda: manager.check(frame_locals)
    except Exception:
        return None


def row(name, seconds, eager):
    ratio = f"{seconds / eager:6.2f}x" if eager else "      "
    return f"  {name:<44} {seconds * 1e6:10.2f} us  {ratio}"


def bench_tiny(calls: int, with_compile: bool):
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    systems = {"eager": tiny, "keraunos": keraunos.jit(tiny),
               "keraunos + ExtractionOnlyPrologueTransform":
                   keraunos.jit(tiny, transforms=[ExtractionOnlyPrologueTransform()])}
    if with_compile:
        systems["torch.compile"] = torch.compile(tiny)
    times = {}
    for name, fn in systems.items():
        torch.testing.assert_close(fn(x, y), tiny(x, y))
        times[name] = median_time(lambda: fn(x, y), calls)
    print("tiny function gelu(x @ y + 1).sum(-1), x 4x8, y 8x8: whole call (ratio to eager)")
    for name, t in times.items():
        print(row(name, t, times["eager"]))
    return times


def interleaved_times(fns: dict, calls: int, batch: int = 100) -> dict[str, float]:
    """Per-call thread CPU time of each callable: batches of ``batch`` calls, the callables
    taking turns, and for each the 10th percentile of its batches. Taking turns puts a change
    of the machine's load on all of them alike (timing one after the other compared one
    stretch of load with another: 1.59x here for what is 1.06x in instructions, by callgrind);
    a low percentile of thread time leaves out the batches other processes interrupted."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(calls // batch, 10)):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(batch):
                fn()
            samples[name].append((time.thread_time() - t0) / batch)
    return {name: sorted(v)[len(v) // 10] for name, v in samples.items()}


def bench_symbolic(calls: int):
    """The tiny function's cache hit on a static entry and on a symbolic one (dynamic=True: every
    size a symbol, its guards and bindings checked in the prologue): the prologue alone, the
    computation alone and the whole call, each with its ratio to the static entry's, all timed
    in turns (``interleaved_times``)."""
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    systems = {"keraunos, static entry": keraunos.jit(tiny, dynamic=False),
               "keraunos, symbolic entry": keraunos.jit(tiny, dynamic=True)}
    fns = {}
    for name, fn in systems.items():
        torch.testing.assert_close(fn(x, y), tiny(x, y))
        entry = keraunos.state_of(fn).last_entry
        inputs = entry.prologue_fn(x, y)[0]
        fns[("prologue alone", name)] = lambda entry=entry: entry.prologue_fn(x, y)
        fns[("computation alone", name)] = lambda e=entry, i=inputs: e.computation_fn(*i)
        fns[("whole call", name)] = lambda fn=fn: fn(x, y)
    times = interleaved_times(fns, calls * 2)
    assert keraunos.cache_misses(systems["keraunos, symbolic entry"]) == 1
    static = "keraunos, static entry"
    print("\ntiny function, symbolic vs static cache entry (ratio to the static entry; "
          "thread time, timed in turns)")
    results = {}
    for label in ("prologue alone", "computation alone", "whole call"):
        print(f"  {label}")
        results[label] = {name: times[(label, name)] for name in systems}
        for name, t in results[label].items():
            print(row("  " + name, t, results[label][static]))
    return results


def llama3_shaped():
    import litgpt
    from litgpt.model import GPT
    config = litgpt.Config.from_name("Llama-3-8B", n_embd=128, intermediate_size=256,
                                     padded_vocab_size=256, vocab_size=256, block_size=64)
    torch.manual_seed(0)
    return GPT(config).eval()


def bench_llama(calls: int, with_compile: bool):
    model = llama3_shaped()
    idx = torch.randint(0, 256, (1, 8))
    full = keraunos.jit(model)
    extraction = keraunos.jit(model, transforms=[ExtractionOnlyPrologueTransform()])
    systems = {"eager": model, "keraunos": full,
               "keraunos + ExtractionOnlyPrologueTransform": extraction}
    if with_compile:
        systems["torch.compile"] = torch.compile(model)
    prologue, whole = {}, {}
    with torch.no_grad():
        expected = model(idx)
        for name, fn in systems.items():
            torch.testing.assert_close(fn(idx), expected)
        for name in ("keraunos", "keraunos + ExtractionOnlyPrologueTransform"):
            entry = keraunos.state_of(systems[name]).last_entry
            prologue[name] = median_time(lambda: entry.prologue_fn(idx), calls * 5)
        if with_compile:
            check = dynamo_guard_check(systems["torch.compile"], type(model).forward.__code__,
                                       {"self": model, "idx": idx, "input_pos": None,
                                        "input_pos_maxp1": None, "lm_head_chunk_size": 0})
            if check is not None:
                prologue["torch.compile (its guards)"] = median_time(check, calls * 5)
        tensors = [idx] + list(model.parameters()) + list(model.buffers())
        loop = reference_check_loop(tensors, [(t.shape, t.dtype, t.device, t.requires_grad)
                                              for t in tensors])
        assert loop()
        reference = median_time(loop, calls * 5)
        for name, fn in systems.items():
            whole[name] = median_time(lambda: fn(idx), calls)
    n_params = sum(1 for _ in model.parameters())
    print(f"\nLlama-3-8B-shaped litgpt GPT ({model.config.n_layer} layers, {n_params} parameter "
          f"tensors, n_embd {model.config.n_embd}), idx (1, 8), no_grad")
    print(f"  reference: plain Python loop checking {len(tensors)} tensors"
          f" {reference * 1e6:10.2f} us")
    print("  prologue alone (ratio to the reference loop)")
    for name, t in prologue.items():
        print(row("  " + name, t, reference))
    print("  whole call (ratio to eager)")
    for name, t in whole.items():
        print(row("  " + name, t, whole["eager"]))
    return prologue, whole, reference


CALL_SYSTEMS = {
    "eager": lambda m: m,
    "keraunos.jit": lambda m: keraunos.jit(m, fuse="off"),
    "backend": lambda m: torch.compile(m, backend="keraunos"),
    "inductor": lambda m: torch.compile(m),
    "dynamo": lambda m: torch.compile(m, backend="eager"),
}
COMPILE_SYSTEMS = ("backend", "inductor", "dynamo")


def tiny_relu(x):
    return (x * 2 + 1).relu()


# A program builds its target, hands it to ``make`` (one of CALL_SYSTEMS) and returns
# (step, what make returned): step() is one call, returning the output.

def tiny_program(make):
    run, x = make(tiny_relu), torch.randn(4)
    return (lambda: run(x)), run


def mlp_program(make, grad: bool):
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    run, x = make(mlp), torch.randn(2, 8)
    if grad:
        return (lambda: run(x)), run

    def step():
        with torch.no_grad():
            return run(x)
    return step, run


def decode_program(make):
    """Each system gets its own copy of the model and so its own KV cache; every copy's first
    call is the same (token 5 at position 9 into an empty cache), which is what the check
    compares."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from generate import litgpt_model
    module = litgpt_model()
    module.max_seq_length = 256
    module.set_kv_cache(batch_size=1)
    run, token, position = make(module), torch.tensor([[5]]), [0]

    @torch.inference_mode()
    def step():
        pos = position[0] % 200 + 9
        position[0] += 1
        return run(token, input_pos=torch.tensor([pos]))
    return step, run


CALL_PROGRAMS = {
    "tiny": tiny_program,
    "mlp": lambda make: mlp_program(make, grad=False),
    "mlp-grad": lambda make: mlp_program(make, grad=True),
    "decode": decode_program,
}


def compilations(wrapped: dict) -> tuple:
    """What a recompile during timing would change: Dynamo's graph count and the misses of
    every keraunos.jit cache."""
    from torch._dynamo.utils import counters
    misses = tuple(keraunos.cache_misses(fn) for fn in wrapped.values()
                   if hasattr(fn, "_keraunos"))
    return counters["stats"]["unique_graphs"], misses


def wait_for_background_fusion(name: str, run) -> None:
    """The keraunos backend fuses in the background (its default fuse="background"): wait, so
    that what is timed is the program it settles on, and so that its Inductor compile never
    runs on its thread while the next system compiles with Inductor on this one (they share
    Inductor's global state: one run here failed in make_fx that way)."""
    if name == "backend":
        from keraunos.dynamo.backend import subgraphs_of
        for subgraph in subgraphs_of(run):
            keraunos.wait_for_fusion(subgraph.jitted)


BLOCK = 25  # calls a turn


def blocks_for(calls: int) -> int:
    return max(calls // BLOCK, 5)


def round_robin(steps: dict, calls: int, block: int = BLOCK) -> dict[str, float]:
    """Median per-call wall time of each step: blocks of ``block`` calls, the steps taking turns
    and the order rotating each round, so the machine's load falls on all of them alike."""
    for step in steps.values():
        for _ in range(20):
            step()
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(blocks_for(calls)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = steps[name]
            t0 = time.perf_counter()
            for _ in range(block):
                step()
            samples[name].append((time.perf_counter() - t0) / block)
    return {name: statistics.median(v) for name, v in samples.items()}


def bench_program(label: str, program, systems: list[str], calls: int) -> dict[str, float]:
    torch._dynamo.reset()  # a fresh Dynamo cache per program, its systems compiled side by side
    steps, wrapped, expected = {}, {}, None
    for name in systems:
        torch.manual_seed(0)  # the same weights and inputs for every system
        steps[name], wrapped[name] = program(CALL_SYSTEMS[name])
        out = steps[name]().detach()
        if expected is None:
            expected = out
        torch.testing.assert_close(out, expected, msg=lambda m, name=name:
                                   f"{name} differs from eager: {m}")
        wait_for_background_fusion(name, wrapped[name])
    for step in steps.values():
        step()  # a second call: a compile that the first call's values trigger happens here
    before = compilations(wrapped)
    times = round_robin(steps, calls)
    if compilations(wrapped) != before:
        print(f"  {label}: recompiled while timed (Dynamo graphs, keraunos.jit misses): "
              f"{before} -> {compilations(wrapped)}")
    return times


def cell(seconds: float, reference: float) -> str:
    return f"{seconds * 1e6:8.2f} {seconds / reference:5.2f}x"


def bench_calls(calls: int, with_compile: bool, programs: list[str] | None = None,
                systems: list[str] | None = None):
    """The per-call table: per-call time of each program under each system, all in this run."""
    # The three torch.compile systems keep their entries under the same code objects (the MLP's
    # forward, the GPT's): room for them all, and for a decode step that recompiles.
    torch._dynamo.config.cache_size_limit = 64
    systems = [s for s in CALL_SYSTEMS if (with_compile or s not in COMPILE_SYSTEMS)
               and (systems is None or s == "eager" or s in systems)]
    results = {}
    for label, program in CALL_PROGRAMS.items():
        if programs is None or label in programs:
            results[label] = bench_program(label, program, systems, calls)
    print(f"per call, us (ratio to eager); median over {blocks_for(calls)} blocks of {BLOCK} "
          "calls a system, the systems taking turns")
    print(f"  {'':10}" + "".join(f"{name:>15}" for name in systems))
    for label, times in results.items():
        print(f"  {label:10}" + "".join(cell(times[s], times["eager"]) for s in systems))
    ratios = [("keraunos.jit / eager", "keraunos.jit", "eager"),
              ("backend / inductor", "backend", "inductor"),
              ("backend / keraunos.jit", "backend", "keraunos.jit")]
    print("\nratios")
    print(f"  {'':10}" + "".join(f"{name:>24}" for name, _, _ in ratios))
    for label, times in results.items():
        print(f"  {label:10}" + "".join(
            f"{times[a] / times[b]:23.2f}x" if a in times and b in times else f"{'-':>24}"
            for _, a, b in ratios))
    return results


def write_json(results: dict, path: str) -> None:
    """The per-call table as benchmarks/report.py renders it: one row per program, each cell
    microseconds and the ratio to eager."""
    systems = list(next(iter(results.values())))
    rows = [[label] + [f"{times[s] * 1e6:.2f} us ({times[s] / times['eager']:.2f}x)"
                       for s in systems] for label, times in results.items()]
    with open(path, "w") as f:
        json.dump({"tables": [{"columns": ["program"] + systems, "rows": rows,
                               "ratios_to": "eager"}]}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--skip-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--only", choices=("calls", "prologue"),
                        help="run one part: the per-call table or the prologue figures")
    parser.add_argument("--programs", help="comma-separated rows of the per-call table "
                        f"(default all: {','.join(CALL_PROGRAMS)})")
    parser.add_argument("--systems", help="comma-separated columns of the per-call table besides "
                        f"eager (default all: {','.join(CALL_SYSTEMS)})")
    parser.add_argument("--json", default="", help="also write the per-call table to this JSON "
                        "file (what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{BLOCK * 5} calls: proves every path runs, measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.calls = BLOCK * 5
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, keraunos {keraunos.__version__}, 1 thread\n")
    if args.only != "prologue":
        results = bench_calls(args.calls, not args.skip_compile,
                              args.programs.split(",") if args.programs else None,
                              args.systems.split(",") if args.systems else None)
        if args.json:
            write_json(results, args.json)
    if args.only == "calls":
        return
    print()
    bench_tiny(args.calls, not args.skip_compile)
    bench_symbolic(args.calls)
    bench_llama(max(args.calls // 20, 50), not args.skip_compile)


if __name__ == "__main__":
    main()
