"""The command line: ``python -m keraunos.cli run`` compiles the shipped GPT and shows its traces.

``bench``: eager, keraunos (torch executor), keraunos (inductor executor) and ``torch.compile`` on
three litgpt workloads, as one table and one PNG chart (``benchmarks/fusion.py``, whose options it
takes: ``keraunos bench --help`` says what each workload is; litgpt and matplotlib are the
``bench`` extra, which ``scripts/setup.sh`` installs).

``cache``: ``keraunos cache info`` shows the store of ``keraunos.store`` (directory, entries,
size, limit) and Inductor's kernel cache the fused tier compiles into (directory, size on disk);
``keraunos cache clear`` empties the store, and with ``--kernels`` removes Inductor's cache too.

``run``: build the small GPT of ``keraunos.examples.gpt`` with random weights, compile it, check it
against eager, print the prologue and computation traces, the per-stage compile times and the
per-call time next to eager's (median of many calls, one intra-op thread). ``--report PATH``
also writes the HTML report of ``keraunos.report``.
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import shutil
import statistics
import sys
import time

import torch

import keraunos
from keraunos.examples.gpt import GPT, GPTConfig
from keraunos.persist.store import Store


WARMUP = 10  # calls before the timed ones


def _median_call_time(fn, args, calls: int) -> float:
    for _ in range(WARMUP):
        fn(*args)
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4)
    model = GPT(config).eval()
    reference = copy.deepcopy(model)
    jmodel = keraunos.jit(model)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    with torch.no_grad():
        start = time.perf_counter()
        logits = jmodel(idx)
        first_call = time.perf_counter() - start
        expected = reference(idx)
    torch.testing.assert_close(logits, expected)
    print(f"keraunos.jit(GPT({config})) on idx {tuple(idx.shape)}: logits match eager "
          f"(max abs diff {(logits - expected).abs().max().item():.2e})")
    print(f"first call (capture, compile, run on the torch executor): {first_call * 1e3:.2f} ms")
    print("=" * 30, "after the first call: compile stages, tier and cache", "=" * 30)
    print(keraunos.compile_stats(jmodel))
    # The fused program compiles in the background (fuse="background", the default); a program
    # never waits for it, this demo does so as to show it.
    start = time.perf_counter()
    keraunos.wait_for_fusion(jmodel)
    print(f"\nthe fused program was ready {time.perf_counter() - start:.2f} s after that first "
          f"call returned; the next calls run it\n")
    with torch.no_grad():
        fused = jmodel(idx)
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-5)

    print("=" * 30, "prologue (last trace)", "=" * 30)
    print(keraunos.last_prologue_traces(jmodel)[-1])
    print("=" * 30, "computation (last trace)", "=" * 30)
    print(keraunos.last_traces(jmodel)[-1])
    print("=" * 30, "epilogue", "=" * 30)
    print(keraunos.last_epilogue_traces(jmodel)[-1])

    print("=" * 30, "after the switch: compile stages, tiers and cache", "=" * 30)
    print(keraunos.compile_stats(jmodel))
    print()

    with torch.no_grad():
        eager = _median_call_time(reference, (idx,), args.calls)
        jitted = _median_call_time(jmodel, (idx,), args.calls)
    stats = keraunos.compile_stats(jmodel)
    print("=" * 30, f"per-call time (median of {args.calls} calls after {WARMUP} warm-up "
          f"calls, 1 thread)", "=" * 30)
    print(f"{'eager':>12}: {eager * 1e6:9.1f} us per call")
    print(f"{'keraunos':>12}: {jitted * 1e6:9.1f} us per call ({jitted / eager:.2f}x eager's), "
          f"of which the cache lookup (prologue checks) took {stats.last_cache_lookup * 1e6:.1f} "
          f"us on the last call")
    print(f"cache, after all {2 + WARMUP + args.calls} calls of the jitted model: "
          f"{stats.cache_hits} hits, {stats.cache_misses} miss"
          f"{'es' if stats.cache_misses != 1 else ''} (the first call, which compiled; the "
          f"switch to the fused tier is no miss)")
    if args.report:
        with torch.no_grad():
            path = keraunos.report(jmodel, args.report, args=(idx,), calls=min(args.calls, 50))
        print(f"\nreport written to {path} (open it in a browser)")
    return 0


def _bench_script(name: str = "fusion"):
    """``benchmarks/<name>.py`` of the source tree keraunos runs from, loaded as a module."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise SystemExit(f"keraunos bench: {path} is missing; the benchmarks ship with the "
                         f"source tree (run it from a clone of keraunos)")
    spec = importlib.util.spec_from_file_location(f"keraunos_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def bench(argv: list[str]) -> int:
    if argv[:1] == ["tiers"]:  # keraunos bench tiers: benchmarks/tiers.py
        return _bench_script("tiers").main(argv[1:])
    return _bench_script().main(argv)


def _inductor_cache_dir() -> pathlib.Path:
    """Where Inductor keeps its C++/Triton kernels, found without creating it (its
    ``cache_dir()`` makes the directory and sets TORCHINDUCTOR_CACHE_DIR)."""
    from .torch_internals.inductor import cache_dir_utils
    return pathlib.Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                        or cache_dir_utils.default_cache_dir()).absolute()


def _size_on_disk(directory: pathlib.Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while we walk (another process's compile)
                pass
    return total


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def cache(args: argparse.Namespace) -> int:
    store = Store()
    if args.action == "info":
        info = store.info()
        print(f"keraunos store:        {store.directory}")
        print(f"  entries:             {info['entries']}")
        print(f"  size:                {_human(info['bytes'])} of {_human(info['limit'])} "
              f"(KERAUNOS_STORE_MAX_BYTES)")
        if info["error"]:
            print(f"  unreadable:          {info['error']}")
        kernels = _inductor_cache_dir()
        size = _human(_size_on_disk(kernels)) if kernels.is_dir() else "absent"
        print(f"Inductor kernel cache: {kernels} ({size}; TORCHINDUCTOR_CACHE_DIR)")
        return 0
    status = 0
    if store.clear():
        print(f"emptied the keraunos store in {store.directory}")
    else:
        print(f"keraunos cache clear: could not empty {store.directory}; check its permissions "
              f"or remove it by hand", file=sys.stderr)
        status = 1
    if args.kernels:
        kernels = _inductor_cache_dir()
        if kernels in (pathlib.Path(kernels.anchor), pathlib.Path.home()):
            print(f"keraunos cache clear: refusing to remove {kernels} (TORCHINDUCTOR_CACHE_DIR "
                  f"names a root or home directory)", file=sys.stderr)
            return 1
        try:
            shutil.rmtree(kernels)
            print(f"removed Inductor's kernel cache {kernels}")
        except FileNotFoundError:
            print(f"Inductor's kernel cache {kernels} is already absent")
        except OSError as error:
            print(f"keraunos cache clear: could not remove {kernels}: {error}", file=sys.stderr)
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option is the script's own (keraunos bench --help)
        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="keraunos", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="compile and run the shipped small GPT, show traces and timings")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--report", metavar="PATH", help="also write the HTML report (keraunos.report): "
                   "every trace after every pass, compile stages, cache misses, per-call timings")
    sub.add_parser("bench", help="eager vs keraunos vs keraunos+inductor vs torch.compile on "
                   "three litgpt workloads (a: inference, overhead-bound; b: inference, "
                   "compute-bound; c: a training step): a table and a PNG chart; keraunos bench "
                   "--help says what each workload is; keraunos bench tiers [--help]: first result, all "
                   "fused, restart and per call against regional and async torch.compile",
                   add_help=False)
    p = sub.add_parser("cache", help="the keraunos store and Inductor's kernel cache: info shows "
                       "where they are and their size; clear empties the store (--kernels: and "
                       "removes Inductor's kernel cache, so the next fused compile rebuilds)")
    p.add_argument("action", choices=["info", "clear"])
    p.add_argument("--kernels", action="store_true",
                   help="clear: also remove Inductor's kernel cache directory")
    args = parser.parse_args(argv)
    return cache(args) if args.command == "cache" else run(args)


if __name__ == "__main__":
    sys.exit(main())
