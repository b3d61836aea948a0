"""Reliability under load: memory over many compilations and evictions, and threads.

Run: python benchmarks/reliability.py [--calls 10000] [--shapes 40] [--threads 8] [--per-thread 500]

- memory: one jitted module called ``--calls`` times cycling ``--shapes`` input shapes with the
  default 8-entry cache, twice: with ``dynamic=False``, so nearly every call compiles and evicts,
  and with automatic dynamic sizes (the default), so a few entries serve every shape. Resident memory, Python heap
  (tracemalloc), linecache entries and live keraunos traces are printed after warm-up and at the
  end; "flat" means the end is within noise of the warm-up figures. Also checks that a deleted
  jitted module and its model are freed.
- threads: ``--threads`` threads each make ``--per-thread`` calls of one jitted function with
  mixed shapes and grad on/off; every result is compared with eager, and hits + misses must equal
  the number of calls.
Compared with eager in the same run where that means anything (the results); the memory figures
are absolute.
"""
from __future__ import annotations

import argparse
import gc
import linecache
import threading
import tracemalloc
import weakref

import torch

import keraunos
from keraunos.core.trace import Trace


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls.add_(1)
        return self.norm(torch.relu(self.fc(x)) + x).sum(-1)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def live_traces() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, Trace))


def snapshot(label: str) -> tuple[float, float, int, int]:
    gc.collect()
    figures = (rss_mib(), tracemalloc.get_traced_memory()[0] / 2**20, len(linecache.cache),
               live_traces())
    print(f"{label:>24}: rss {figures[0]:8.1f} MiB  python heap {figures[1]:8.2f} MiB  "
          f"linecache {figures[2]:6d}  live traces {figures[3]:6d}")
    return figures


def memory(calls: int, shapes: int, dynamic: bool | None, rows: list | None = None) -> bool:
    """``dynamic=False``: every size is compiled in, so with 40 shapes and 8 entries nearly every
    call compiles and evicts (the worst case for memory); ``None``: automatic dynamic sizes."""
    print(f"memory, jit(model, dynamic={dynamic}):")
    torch.manual_seed(0)
    model = Block()
    jm = keraunos.jit(model, dynamic=dynamic)
    inputs = [torch.randn(1 + i % 5, 2 + i // 5, 16) for i in range(shapes)]
    tracemalloc.start()
    warm = calls // 10
    with torch.no_grad():
        for i in range(warm):
            jm(inputs[i % shapes])
        start = snapshot(f"after {warm} calls")
        for i in range(warm, calls):
            jm(inputs[i % shapes])
        end = snapshot(f"after {calls} calls")
    tracemalloc.stop()
    misses = keraunos.cache_misses(jm)
    print(f"{'cache misses':>24}: {misses} of {calls} calls "
          f"(max_cache_entries=8, {shapes} shapes)")
    heap_growth = end[1] - start[1]
    flat = heap_growth < 2.0 and end[2] - start[2] < 50 and end[3] - start[3] < 50
    print(f"{'python heap growth':>24}: {heap_growth:+.2f} MiB -> {'flat' if flat else 'GROWS'}")
    model_ref, jm_ref = weakref.ref(model), weakref.ref(jm)
    del jm, model
    gc.collect()
    freed = model_ref() is None and jm_ref() is None
    print(f"{'deleted module freed':>24}: {freed}")
    if rows is not None:
        rows.append([f"jit(model, dynamic={dynamic})", f"{calls}, {shapes} shapes",
                     str(misses), f"{start[0]:.1f} MiB", f"{end[0]:.1f} MiB",
                     f"{heap_growth:+.2f} MiB ({'flat' if flat else 'GROWS'})",
                     "yes" if freed else "NO"])
    return flat and freed


def threads(n_threads: int, per_thread: int, rows: list | None = None) -> bool:
    torch.manual_seed(0)
    weight = torch.randn(16, 16, requires_grad=True)

    def program(x, w):
        return torch.tanh(x @ w).sum(-1)

    jf = keraunos.jit(program, max_cache_entries=32)
    xs = [torch.randn(1 + i, 16) for i in range(4)]
    failures: list[str] = []

    def worker(k: int):
        for i in range(per_thread):
            x = xs[(i + k) % len(xs)]
            with torch.set_grad_enabled((i + k) % 2 == 0):
                got, want = jf(x, weight), program(x, weight)
            if not torch.equal(got, want) or got.requires_grad != want.requires_grad:
                failures.append(f"thread {k} call {i}: result differs from eager")
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    total = keraunos.cache_hits(jf) + keraunos.cache_misses(jf)
    print(f"{'threads':>24}: {n_threads} x {per_thread} calls, {len(failures)} results differ "
          f"from eager, hits + misses = {total} (expected {n_threads * per_thread}), "
          f"misses {keraunos.cache_misses(jf)}")
    if rows is not None:
        rows.append([f"{n_threads} threads x {per_thread} calls", str(len(failures)),
                     f"{total} (expected {n_threads * per_thread})",
                     str(keraunos.cache_misses(jf))])
    return not failures and total == n_threads * per_thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--shapes", type=int, default=40)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--per-thread", type=int, default=500)
    parser.add_argument("--json", default="", help="also write the figures to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="500 calls, 2 threads x 20: proves every path runs")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.threads, args.per_thread = 500, 2, 20
    torch.set_num_threads(1)
    import warnings
    warnings.simplefilter("ignore")  # the one-time "recompiling often" warning is expected here
    memory_rows, thread_rows = [], []
    ok = memory(args.calls, args.shapes, dynamic=False, rows=memory_rows)
    ok = memory(args.calls, args.shapes, dynamic=None, rows=memory_rows) and ok
    ok = threads(args.threads, args.per_thread, thread_rows) and ok
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"tables": [
                {"caption": "memory over many compilations and evictions",
                 "columns": ["jitted module", "calls", "compilations", "RSS after warm-up",
                             "RSS at the end", "Python heap growth", "deleted module freed"],
                 "rows": memory_rows},
                {"caption": "threads: one jitted function, mixed shapes, grad on and off",
                 "columns": ["threads", "results differing from eager", "hits + misses",
                             "compilations"],
                 "rows": thread_rows}]}, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
