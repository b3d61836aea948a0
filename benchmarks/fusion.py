"""Fusion: eager vs keraunos (torch executor) vs keraunos (inductor executor) vs torch.compile.

Run: python benchmarks/fusion.py [--workloads a,b,c] [--iters N] [--warm] [--skip-compile]

Workloads (one intra-op thread):
  a  the 32-layer Llama-3-8B-shaped litgpt GPT at tiny widths, input (1, 8), no_grad;
  b  a compute-bound litgpt Llama-2 config (4 layers, n_embd 1024), batch 4x128, no_grad;
  c  the training step of benchmarks/train.py (forward, backward, AdamW step).

Each (workload, system) runs in a process of its own with an empty Inductor cache directory, so
keraunos and torch.compile both compile cold and neither reuses the other's kernels; ``--warm``
runs the compiling systems a second time on the cache the first run left (a new process, warm
disk). Figures: compile + warm-up by the 2N method (time 2N calls; sum of the first N minus sum of
the last N), steady-state median per call (of the last N), its ratios to eager and to
torch.compile measured in the same run, and the largest difference from eager's output.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEMS = ("eager", "keraunos", "keraunos+inductor", "torch.compile")
COMPILING = ("keraunos", "keraunos+inductor", "torch.compile")


def _wrap(system: str, model):
    import torch
    import keraunos
    if system == "eager":
        return model
    if system == "keraunos":
        return keraunos.jit(model)
    if system == "keraunos+inductor":
        return keraunos.jit(model, executors=["inductor", "torch"])
    return torch.compile(model)


def _litgpt(name: str, **overrides):
    import torch
    import litgpt
    from litgpt.model import GPT
    torch.manual_seed(0)
    return GPT(litgpt.Config.from_name(name, **overrides)).eval()


def _inference(model, idx):
    import torch

    def call():
        with torch.no_grad():
            return model(idx)
    return call


def workload_a(system: str):
    import torch
    model = _litgpt("Llama-3-8B", n_embd=128, intermediate_size=256, padded_vocab_size=256,
                    vocab_size=256, block_size=64)
    idx = torch.randint(0, 256, (1, 8))
    return _inference(model, idx), _inference(_wrap(system, model), idx)


def workload_b(system: str):
    import torch
    model = _litgpt("Llama-2-7b-hf", n_layer=4, n_embd=1024, n_head=16, n_query_groups=16,
                    intermediate_size=2816, padded_vocab_size=512, vocab_size=512, block_size=128)
    idx = torch.randint(0, 512, (4, 128))
    return _inference(model, idx), _inference(_wrap(system, model), idx)


def workload_c(system: str):
    import copy
    import torch
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
    spec = importlib.util.spec_from_file_location("keraunos_bench_train", path)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    base = train.make_model(4, 256)
    idx, targets = torch.randint(0, 512, (1, 64)), torch.randint(0, 512, (1, 64))
    steps = []
    for wrap in (lambda m: m, lambda m: _wrap(system, m)):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps.append(train.step_fn(wrap(model), optimizer, idx, targets))
    return steps[0], steps[1]


WORKLOADS = {"a": workload_a, "b": workload_b, "c": workload_c}
TITLES = {"a": "Llama-3-8B-shaped, 32 layers, tiny widths, (1, 8), no_grad",
          "b": "litgpt Llama-2, 4 layers, n_embd 1024, batch 4x128, no_grad",
          "c": "training step of benchmarks/train.py (4 layers, n_embd 256, batch 1x64, AdamW)"}


def child(workload: str, system: str, iters: int) -> dict:
    """One measurement, in this process: the 2N method and the difference from eager."""
    import torch
    torch.set_num_threads(1)
    reference, run = WORKLOADS[workload](system)
    expected = reference()
    times = []
    for _ in range(2 * iters):
        t0 = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t0)
    diff = (result - expected).abs().max().item() if workload != "c" else float("nan")
    return dict(compile=sum(times[:iters]) - sum(times[iters:]),
                median=statistics.median(times[iters:]), first=times[0], diff=diff)


def measure(workload: str, system: str, iters: int, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload, system,
                          "--iters", str(iters)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return dict(error=(out.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(workload: str, results: dict, note: str = "") -> None:
    print(f"\n({workload}) {TITLES[workload]}{note}")
    print(f"  {'system':<24} {'compile+warmup':>15} {'per call':>12} {'vs eager':>9} "
          f"{'vs torch.compile':>17} {'max |diff|':>11}")
    eager = results.get("eager", {}).get("median")
    compiled = results.get("torch.compile", {}).get("median")
    for name, r in results.items():
        if "error" in r:
            print(f"  {name:<24} failed: {r['error']}")
            continue
        vs_eager = f"{r['median'] / eager:8.2f}x" if eager else f"{'':>9}"
        vs_compile = f"{r['median'] / compiled:16.2f}x" if compiled else f"{'':>17}"
        diff = f"{r['diff']:11.2e}" if r["diff"] == r["diff"] else f"{'n/a':>11}"
        print(f"  {name:<24} {r['compile']:13.2f} s {r['median'] * 1e3:9.3f} ms {vs_eager} "
              f"{vs_compile} {diff}")
    fused, tc = results.get("keraunos+inductor", {}), results.get("torch.compile", {})
    if "compile" in fused and "compile" in tc and tc["compile"] > 0:
        print(f"  compile+warmup, keraunos+inductor / torch.compile: "
              f"{fused['compile'] / tc['compile']:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="a,b,c")
    parser.add_argument("--iters", type=int, default=20, help="N of the 2N method")
    parser.add_argument("--warm", action="store_true", help="also rerun on the warm disk cache")
    parser.add_argument("--skip-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.iters)))
        return
    import torch
    systems = [s for s in SYSTEMS if not (args.skip_compile and s == "torch.compile")]
    print(f"torch {torch.__version__}, 1 thread, 2N method with N = {args.iters}, "
          f"cold Inductor cache per system")
    for workload in args.workloads.split(","):
        results, caches = {}, {}
        for system in systems:
            caches[system] = tempfile.mkdtemp(prefix=f"keraunos_fusion_{workload}_")
            results[system] = measure(workload, system, args.iters, caches[system])
        report(workload, results)
        if args.warm:  # a new process on the cache its first run left
            warm = {s: (measure(workload, s, args.iters, caches[s]) if s in COMPILING else r)
                    for s, r in results.items()}
            report(workload, warm, "; second run, warm disk cache")


if __name__ == "__main__":
    main()
