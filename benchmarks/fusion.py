"""Fusion: eager vs keraunos (torch executor) vs keraunos (inductor executor) vs torch.compile.

Run: ``keraunos bench`` (or ``python benchmarks/fusion.py``) with ``[--workloads a,b,c]
[--systems ...] [--iters N] [--quick] [--no-warm] [--chart PATH] [--json PATH] [--device cuda]``

Workloads (one intra-op thread):
  a  the 32-layer Llama-3-8B-shaped litgpt GPT at tiny widths, input (1, 8), no_grad;
  b  a compute-bound litgpt Llama-2 config (4 layers, n_embd 1024), batch 4x128, no_grad;
  c  the training step of benchmarks/train.py (forward, backward, AdamW step).

Each (workload, system) runs in a process of its own with an empty Inductor cache directory, so
keraunos and torch.compile both compile cold and neither reuses the other's kernels; then the
compiling systems run a second time on the cache their first run left (a new process, warm disk;
``--no-warm`` skips that). Figures per run: compile + warm-up by the 2N method (time 2N calls; the
sum of the first N minus the sum of the last N, i.e. what the calls cost beyond N + N steady
ones), the steady-state median per call or step (of the last N), its ratios to eager and to
torch.compile of the same run, the process's peak memory (``ru_maxrss``: tracemalloc does not see
tensors and the CPU allocator keeps no statistics; on CUDA, ``max_memory_allocated``), the bytes
saved for backward by one forward (c), and the largest difference from eager (a, b: the output;
c: the loss after 2N steps). Prints one table and writes one PNG chart (matplotlib: the ``bench``
extra, ``pip install 'keraunos[bench]'``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SYSTEMS = ("eager", "keraunos", "keraunos+inductor", "torch.compile")
COMPILING = ("keraunos", "keraunos+inductor", "torch.compile")
TITLES = {"a": "Llama-3-8B-shaped, 32 layers, tiny widths, (1, 8), no_grad",
          "b": "litgpt Llama-2, 4 layers, n_embd 1024, batch 4x128, no_grad",
          "c": "training step of benchmarks/train.py (4 layers, n_embd 256, batch 1x64, AdamW)"}
QUICK_ITERS = 2  # --quick: enough to prove every path runs, far too few to measure anything


@dataclass
class Workload:
    """One (workload, system) made ready: ``run()`` is one timed call or step; ``expected()``
    eager's result to compare the last one with (run after the measurement, so that eager's
    memory is not in the peak); ``saved()`` the bytes one forward saves for backward."""

    run: object
    expected: object
    compare: object           # (last result, expected) -> largest difference
    saved: object = None
    jitted: object = None     # the keraunos callable, for its fusion regions


def _wrap(system: str, model):
    import torch
    import keraunos
    if system == "eager":
        return model
    if system == "keraunos":
        return keraunos.jit(model, fuse="off")
    if system == "keraunos+inductor":
        return keraunos.jit(model, executors=["inductor", "torch"], fuse="wait")
    return torch.compile(model)


def _litgpt(name: str, device: str, **overrides):
    import torch
    import litgpt
    from litgpt.model import GPT
    torch.manual_seed(0)
    return GPT(litgpt.Config.from_name(name, **overrides)).eval().to(device)


def _inference(system: str, model, idx) -> Workload:
    import torch
    wrapped = _wrap(system, model)

    def call(fn):
        with torch.no_grad():
            return fn(idx)
    return Workload(lambda: call(wrapped), lambda: call(model),
                    lambda got, want: (got - want).abs().max().item(),
                    jitted=wrapped if system.startswith("keraunos") else None)


def workload_a(system: str, device: str) -> Workload:
    import torch
    model = _litgpt("Llama-3-8B", device, n_embd=128, intermediate_size=256,
                    padded_vocab_size=256, vocab_size=256, block_size=64)
    return _inference(system, model, torch.randint(0, 256, (1, 8), device=device))


def workload_b(system: str, device: str) -> Workload:
    import torch
    model = _litgpt("Llama-2-7b-hf", device, n_layer=4, n_embd=1024, n_head=16,
                    n_query_groups=16, intermediate_size=2816, padded_vocab_size=512,
                    vocab_size=512, block_size=128)
    return _inference(system, model, torch.randint(0, 512, (4, 128), device=device))


def _train_module():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
    spec = importlib.util.spec_from_file_location("keraunos_bench_train", path)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


def workload_c(system: str, device: str, iters: int) -> Workload:
    import torch
    train = _train_module()
    idx = torch.randint(0, 512, (1, 64), device=device)
    targets = torch.randint(0, 512, (1, 64), device=device)

    def stepper(wrap):
        model = train.make_model(4, 256).to(device)  # seeded: eager's is the same model
        runner = wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return runner, train.step_fn(runner, optimizer, idx, targets)

    runner, step = stepper(lambda m: _wrap(system, m))

    def eager_loss_after_2n():  # the loss of eager's step 2N, as the timed run's last step
        _, eager_step = stepper(lambda m: m)
        for _ in range(2 * iters - 1):
            eager_step()
        return eager_step()
    return Workload(step, eager_loss_after_2n, lambda got, want: abs(got.item() - want.item()),
                    saved=lambda: train.saved_bytes(runner, idx),
                    jitted=runner if system.startswith("keraunos") else None)


def make_workload(workload: str, system: str, device: str, iters: int) -> Workload:
    if workload == "c":
        return workload_c(system, device, iters)
    return {"a": workload_a, "b": workload_b}[workload](system, device)


def _peak_memory(device: str) -> int:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _fusion_counts(jitted) -> dict:
    import keraunos
    if jitted is None:
        return {}
    regions = keraunos.last_fusions(jitted)
    return dict(regions=len(regions), kernels=len({r.kernel.number for r in regions}))


def child(workload: str, system: str, iters: int, device: str) -> dict:
    """One measurement, in this process: the 2N method, peak memory, the difference from eager."""
    import torch
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    w = make_workload(workload, system, device, iters)
    before = _peak_memory(device)
    times = []
    for _ in range(2 * iters):
        t0 = time.perf_counter()
        result = w.run()
        sync()
        times.append(time.perf_counter() - t0)
    peak = _peak_memory(device)
    saved = w.saved() if w.saved is not None else None
    return dict(compile=sum(times[:iters]) - sum(times[iters:]),
                median=statistics.median(times[iters:]), first=times[0], peak=peak,
                peak_over_setup=peak - before, saved=saved,
                diff=w.compare(result, w.expected()), **_fusion_counts(w.jitted))


def measure(workload: str, system: str, iters: int, cache_dir: str, device: str) -> dict:
    """``child`` in a process of its own, on the Inductor cache directory ``cache_dir``."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1",
               KERAUNOS_CACHE_DIR=os.path.join(cache_dir, "keraunos-store"))  # cold: both empty
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload, system,
                          "--iters", str(iters), "--device", device],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return dict(error=(out.stderr.strip().splitlines() or ["failed"])[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_workload(workload, systems, iters: int, warm: bool, device: str) -> list:
    """Rows ``{workload, system, cold, warm}``: every system cold, the compiling ones warm too
    (each run's outcome printed as it ends: the whole table can take many minutes)."""
    rows = []
    for system in systems:
        cache = tempfile.mkdtemp(prefix=f"keraunos_bench_{workload}_")
        row = dict(workload=workload, system=system,
                   cold=measure(workload, system, iters, cache, device), warm=None)
        _progress(workload, system, "cold", row["cold"])
        if warm and system in COMPILING:
            row["warm"] = measure(workload, system, iters, cache, device)
            _progress(workload, system, "warm", row["warm"])
        rows.append(row)
    return rows


def _compile_seconds(seconds: float, width: int = 0) -> str:
    """The 2N method's compile + warm-up estimate; one below zero means the compile cost is
    below the timing noise (a warm cache, --quick), shown as such rather than as a negative time."""
    text = f"{seconds:.2f} s" if seconds >= 0 else "~0 s"
    return f"{text:>{width}}"


def _progress(workload: str, system: str, cache: str, r: dict) -> None:
    per_call = f"{r['median'] * 1e3:.3f} ms per call" if "median" in r else ""
    outcome = (f"failed: {r['error']}" if "error" in r else
               f"compile + warm-up {_compile_seconds(r['compile'])}, {per_call}"
               if system in COMPILING else
               per_call)
    print(f"  ({workload}) {system}, {cache} cache: {outcome}", flush=True)


def _steady(row):
    """The figures of a row's steady state: its warm run's when it has one (no compile in it)."""
    r = row["warm"] if row["warm"] and "error" not in row["warm"] else row["cold"]
    return r if "error" not in r else None


def table(rows: list) -> str:
    head = (f"  {'system':<19} {'compile cold':>12} {'warm':>8} {'per call':>11} "
            f"{'vs eager':>8} {'vs t.c.':>8} {'peak MiB':>9} {'saved MiB':>9} {'max diff':>9}"
            f"  regions/kernels")
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        base = {r["system"]: _steady(r) for r in mine}
        eager, compiled = base.get("eager"), base.get("torch.compile")
        lines += ["", f"({workload}) {TITLES[workload]}", head]
        for r in mine:
            lines.append(_table_line(r, eager, compiled))
        cold = {r["system"]: r["cold"] for r in mine}
        fused, tc = cold.get("keraunos+inductor", {}), cold.get("torch.compile", {})
        if "compile" in fused and "compile" in tc and tc["compile"] > 0:
            lines.append(f"  cold compile+warmup, keraunos+inductor / torch.compile: "
                         f"{fused['compile'] / tc['compile']:.3f}")
    return "\n".join(lines + ["", COLUMNS])


COLUMNS = """columns: compile cold / warm: compile + warm-up in seconds (the 2N method), on an empty
  Inductor cache and on the cache the cold run left ('-' for eager, which compiles nothing;
  '~0' where the estimate came out below zero: a compile cost below the timing noise);
  per call: the steady-state median per call or step, in ms; vs eager, vs t.c.: that median
  relative to eager's and torch.compile's; peak MiB: the process's peak memory; saved MiB:
  what one forward saves for backward (c); max diff: the largest absolute difference from
  eager's output (a, b) or loss after 2N steps (c); regions/kernels: fused regions and the
  distinct kernels compiled for them."""


def report_tables(rows: list) -> dict:
    """The rows of ``--json`` as benchmarks/report.py renders them: one table per workload, one
    row per system."""
    tables = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        base = {r["system"]: _steady(r) for r in mine}
        eager, compiled = base.get("eager"), base.get("torch.compile")
        out = []
        for row in mine:
            cold, name = row["cold"], row["system"]
            if "error" in cold:
                out.append([name, "failed: " + cold["error"]] + ["-"] * 6)
                continue
            r = _steady(row)
            warm = row["warm"] if row["warm"] and "compile" in row["warm"] else None
            out.append([
                name, _compile_seconds(cold["compile"]) if name in COMPILING else "-",
                _compile_seconds(warm["compile"]) if warm else "-",
                f"{r['median'] * 1e3:.3f} ms",
                f"{r['median'] / eager['median']:.2f}x" if eager else "-",
                f"{r['median'] / compiled['median']:.2f}x" if compiled else "-",
                f"{cold['peak'] / 2**20:.1f}",
                f"{cold['saved'] / 2**20:.2f}" if cold.get("saved") is not None else "-"])
        tables.append({"caption": f"({workload}) {TITLES[workload]}",
                       "columns": ["system", "compile + warm-up, cold", "warm", "per call",
                                   "vs eager", "vs torch.compile", "peak MiB", "saved MiB"],
                       "rows": out, "ratios_to": "eager, torch.compile"})
    return {"tables": tables}


def _table_line(row, eager, compiled) -> str:
    cold, name = row["cold"], row["system"]
    if "error" in cold:
        return f"  {name:<19} failed: {cold['error']}"
    r = _steady(row)
    warm = _compile_seconds(row["warm"]["compile"], 8) if row["warm"] and "compile" in row["warm"] \
        else f"{'':>8}"
    ratio = (lambda ref: f"{r['median'] / ref['median']:7.2f}x" if ref else f"{'':>8}")
    saved = f"{cold['saved'] / 2**20:9.2f}" if cold.get("saved") is not None else f"{'':>9}"
    counts = f"  {cold['regions']}/{cold['kernels']}" if "regions" in cold else ""
    compile_cold = _compile_seconds(cold["compile"], 12) if name in COMPILING else f"{'-':>12}"
    return (f"  {name:<19} {compile_cold} {warm} {r['median'] * 1e3:8.3f} ms "
            f"{ratio(eager)} {ratio(compiled)} {cold['peak'] / 2**20:9.1f} {saved} "
            f"{cold['diff']:9.2e}{counts}")


def chart(rows: list, path: str) -> bool:
    """One PNG: per call relative to eager, and compile + warm-up cold and warm, per workload.
    Returns False (and says why) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("keraunos bench: no chart written: it needs matplotlib, which the bench extra "
              "installs (pip install 'keraunos[bench]')", file=sys.stderr)
        return False
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    # Per call relative to eager; to torch.compile when eager was not run (--systems).
    reference = "eager" if "eager" in systems else "torch.compile"
    fig, (speed, compile_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        ratios, cold, warm = [], [], []
        for workload in workloads:
            row = next((r for r in rows if r["workload"] == workload and r["system"] == system),
                       None)
            base = next((_steady(r) for r in rows if r["workload"] == workload
                         and r["system"] == reference), None)
            steady = _steady(row) if row else None
            ratios.append(steady["median"] / base["median"] if steady and base else 0.0)
            # Estimates below zero are compile costs below the timing noise: no bar.
            cold.append(max(0.0, row["cold"].get("compile", 0.0)) if row else 0.0)
            warm.append(max(0.0, (row["warm"] or {}).get("compile", 0.0)) if row else 0.0)
        xs = [i + k * width for i in range(len(workloads))]
        speed.bar(xs, ratios, width, label=system)
        if system in COMPILING:
            compile_ax.bar(xs, cold, width, label=f"{system} (cold)")
            compile_ax.bar(xs, warm, width * 0.5, color="black", alpha=0.4)
    for ax, title in ((speed, f"per call or step, relative to {reference} (lower is faster)"),
                      (compile_ax, "compile + warm-up, s (dark: warm disk cache)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
        ax.set_xticklabels([f"({w})" for w in workloads])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle("keraunos bench: " + "; ".join(f"({w}) {TITLES[w]}" for w in workloads),
                 fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# What each workload is and what it stresses, for ``--help``.
DESCRIPTIONS = {
    "a": "inference, overhead-bound: litgpt's Llama-3-8B layout (32 layers, grouped-query "
         "attention) at tiny widths (n_embd 128), one sequence of 8 tokens, no_grad: many small "
         "ops, so what a call costs beyond its kernels shows",
    "b": "inference, compute-bound: a litgpt Llama-2 config of 4 layers at n_embd 1024, batch "
         "4 x 128 tokens, no_grad: large matmuls, where fusing the pointwise ops between them "
         "pays",
    "c": "training: one step (forward, backward, AdamW) of benchmarks/train.py's 4-layer litgpt "
         "GPT at n_embd 256, batch 1 x 64",
}


def workloads_help() -> str:
    """What each workload is, for ``keraunos bench --help``."""
    import textwrap
    lines = ["workloads (--workloads, comma-separated; one intra-op thread):"]
    for w, text in DESCRIPTIONS.items():
        lines += textwrap.wrap(text, 88, initial_indent=f"  {w}  ", subsequent_indent="     ")
    lines += [""] + textwrap.wrap(
        "Each workload builds litgpt models from a config (random weights: nothing is "
        "downloaded), and the chart needs matplotlib: both are in the bench extra (pip install "
        "'keraunos[bench]'), which scripts/setup.sh installs.", 90)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="a,b,c",
                        help="comma-separated, of a, b, c (listed below); default all three")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--iters", type=int, default=20, help="N of the 2N method")
    parser.add_argument("--quick", action="store_true",
                        help=f"N = {QUICK_ITERS}: proves every path runs, measures nothing")
    parser.add_argument("--no-warm", action="store_true",
                        help="skip the second run of each compiling system on its warm cache")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (Triton kernels)")
    parser.add_argument("--chart", default="keraunos_bench.png", help="PNG to write ('' for none)")
    parser.add_argument("--json", default="", help="also write every figure to this JSON file")


def missing_requirements() -> list[str]:
    """The bench extra's packages that are not installed (each workload builds litgpt models)."""
    return [name for name in ("litgpt",) if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keraunos bench", description=__doc__.split("\n")[0],
                                     epilog=workloads_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    iters = QUICK_ITERS if args.quick else args.iters
    if args.child:
        print(json.dumps(child(*args.child, iters, args.device)))
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    unknown = [w for w in workloads if w not in TITLES] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown workloads or systems: {', '.join(unknown)}")
    missing = missing_requirements()
    if missing:
        print(f"keraunos bench: every workload builds litgpt models, and {', '.join(missing)} is "
              f"not installed: pip install 'keraunos[bench]' (or run scripts/setup.sh, which "
              f"installs it)", file=sys.stderr)
        return 2
    import torch
    print(f"torch {torch.__version__}, {args.device}, 1 intra-op thread, 2N method with N = "
          f"{iters}, cold Inductor cache per system" + ("" if args.no_warm else ", then warm"))
    rows = []
    for workload in workloads:
        rows += run_workload(workload, systems, iters, not args.no_warm, args.device)
        if args.json:  # after each workload, so that an interrupted run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(table(rows))
    if args.chart and chart(rows, args.chart):
        print(f"chart written to {args.chart}")
    return 0 if all("error" not in r["cold"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
