"""Tiered compilation: how soon the first result comes, how soon every call runs fused, and the
per-call time after, each system cold in its own process (a fresh Inductor cache directory),
then warm (a second process on the same directory: a restart).

Run: python benchmarks/tiers.py [--layers L] [--width W] [--seq T] [--calls N] [--systems a,b]

Systems: ``eager``; ``keraunos`` (the default: ``fuse="background"``); ``keraunos-wait``
(``fuse="wait"``); ``keraunos-torch`` (``fuse="off"``); ``regional`` (``torch.compile`` of each
block, as torch's docs recommend for repeated layers); ``compile`` (whole-model
``torch.compile``). Columns: time to the first result (from the jit call), time until calls run
fused (keraunos: ``wait_for_fusion`` returns; torch.compile: the first call), and the median of
``--calls`` calls once fused. Ratios are to regional ``torch.compile`` measured in the same run.
One intra-op thread; the model is ``keraunos.examples.gpt.GPT`` under ``no_grad``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEMS = ("eager", "keraunos", "keraunos-wait", "keraunos-torch", "regional", "compile")


def child(system: str, layers: int, width: int, seq: int, calls: int) -> dict:
    import torch
    import keraunos
    from keraunos.examples.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=4, block_size=max(64, seq))).eval()
    idx = torch.randint(0, 256, (1, seq))
    start = time.perf_counter()
    if system == "eager":
        run = model
    elif system.startswith("keraunos"):
        fuse = {"keraunos": "background", "keraunos-wait": "wait", "keraunos-torch": "off"}[system]
        run = keraunos.jit(model, fuse=fuse)
    elif system == "regional":
        for block in model.h:
            block.compile()
        run = model
    else:
        run = torch.compile(model)
    with torch.no_grad():
        run(idx)
        first = time.perf_counter() - start
        if system == "keraunos":
            keraunos.wait_for_fusion(run)
        fused = time.perf_counter() - start
        for _ in range(5):
            run(idx)
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            run(idx)
            samples.append(time.perf_counter() - t0)
    return {"first": first, "fused": fused, "call": statistics.median(samples)}


def measure(system: str, args, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "KERAUNOS_FUSE": ""}
    done = subprocess.run([sys.executable, __file__, "--child", system, "--layers",
                           str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
                           "--calls", str(args.calls)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, args.seq, args.calls)))
        return 0
    rows = {}
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory(prefix="keraunos-tiers-") as cache_dir:
            cold = measure(system, args, cache_dir)
            warm = measure(system, args, cache_dir)
        rows[system] = (cold, warm)
        print(f"  measured {system}", file=sys.stderr, flush=True)
    anchor = rows.get("regional")
    print(f"GPT {args.layers} layers, width {args.width}, (1, {args.seq}), no_grad, 1 thread; "
          f"each system cold in its own process, then a warm restart on the same cache dir")
    header = (f"{'system':<16}{'first result':>14}{'all fused':>12}{'restart first':>15}"
              f"{'restart fused':>15}{'per call':>12}")
    print(header + ("   (ratios to regional torch.compile)" if anchor else ""))
    for system, (cold, warm) in rows.items():
        def r(value, key, row):
            if anchor is None:
                return ""
            base = anchor[0 if row is cold else 1][key]
            return f" ({value / base:.2f}x)"
        print(f"{system:<16}{cold['first']:>11.2f} s{r(cold['first'], 'first', cold)}"
              f"{cold['fused']:>9.2f} s{r(cold['fused'], 'fused', cold)}"
              f"{warm['first']:>12.2f} s{r(warm['first'], 'first', warm)}"
              f"{warm['fused']:>12.2f} s{r(warm['fused'], 'fused', warm)}"
              f"{warm['call'] * 1e6:>9.0f} us{r(warm['call'], 'call', warm)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
