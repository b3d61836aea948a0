"""Tiered compilation: how soon the first result comes, how soon every call runs fused, and the
per-call time after, each system cold in its own process (a fresh Inductor cache directory),
then warm (a second process on the same directory: a restart).

Run: ``keraunos bench tiers`` (or ``python benchmarks/tiers.py``) with ``[--model M] [--train]
[--layers L] [--width W] [--seq T] [--calls N] [--device cuda] [--systems a,b] [--chart PATH]``

Models: ``gpt`` (``keraunos.examples.gpt.GPT``, ``--layers``/``--width``, input (1, ``--seq``));
``llama32`` (the 32-layer Llama-3-8B-shaped litgpt GPT at tiny widths of ``keraunos bench``'s
workload a, input (1, 8)); ``llama2-4`` (``benchmarks/train.py``'s 4-layer Llama-2-shaped
model, width 256, input (1, 64)); ``tiny`` (``benchmarks/overhead.py``'s tiny function,
``gelu(x @ y + 1).sum(-1)``, 4x8) and ``one-op`` (``x.exp()``, 4x8), whose blocks are the whole
function; ``resnet18``, ``mobilenet_v3_small``, ``efficientnet_b0``
(torchvision, random weights, a batch of 2 images of 64x64). ``--train`` times a training step
(forward, a loss, backward, an SGD step) instead of a ``no_grad`` call.

Systems: ``eager``; ``keraunos`` (the default: ``fuse="background"``); ``keraunos-alone`` (the
default without the compile helper processes, ``KERAUNOS_COMPILE_WORKERS=0``);
``keraunos-nostore`` (the default without the program store, ``KERAUNOS_PROGRAM_STORE=0``: a
restart captures the program again); ``keraunos-wait``
(``fuse="wait"``); ``keraunos-torch`` (``fuse="off"``); ``regional`` (``torch.compile`` of each
block, as torch's docs recommend for repeated layers); ``regional-async`` (the same with
``TORCHINDUCTOR_FX_COMPILE_MODE=async+subprocess``: each block runs eager's kernels until its
Inductor graph, compiled in a subprocess, is ready; torch 2.13 calls it experimental, and it
raises on a miss of the FX graph cache, so it runs with that cache off: its restart recompiles);
``compile`` (whole-model ``torch.compile``). Columns: time to the first result (from the jit
call), time until calls run fused (keraunos: ``wait_for_fusion`` returns; torch.compile: the
first call; regional-async: the first call, in a loop of calls, that ran no block eagerly), the
same two after a restart, and the median of ``--calls`` calls once fused (of the restarted
process). Ratios are to regional ``torch.compile`` measured in the same run (or whole-model
``torch.compile`` where regional is not among ``--systems``). One intra-op thread.
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

import torch
import torch.nn.functional as F
from torch import nn

SYSTEMS = ("eager", "keraunos", "keraunos-alone", "keraunos-nostore", "keraunos-wait",
           "keraunos-torch", "regional",
           "regional-async",
           "compile")
MODELS = ("gpt", "llama32", "llama2-4", "resnet18", "mobilenet_v3_small", "efficientnet_b0",
          "tiny", "one-op")
ASYNC_WAIT_S = 900  # regional-async: calls keep running eagerly at most this long
LITGPT_MODELS = ("llama32", "llama2-4")
NEVER_FUSED = ("eager", "keraunos-torch")  # their "fused" columns are shown as "-"
COLUMNS = (("first", "first result"), ("fused", "all fused"), ("restart first", "restart first"),
           ("restart fused", "restart fused"), ("call", "per call"))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.y = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return F.gelu(x @ self.y + 1).sum(-1)


class OneOp(nn.Module):
    def forward(self, x):
        return x.exp()


def build(args):
    """(model, its repeated blocks for regional compiling, the inputs)."""
    torch.manual_seed(0)
    if args.model == "gpt":
        from keraunos.examples.gpt import GPT, GPTConfig
        model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4,
                              block_size=max(64, args.seq)))
        return model, list(model.h), torch.randint(0, 256, (1, args.seq))
    if args.model == "llama32":
        import litgpt
        from litgpt.model import GPT
        model = GPT(litgpt.Config.from_name("Llama-3-8B", n_embd=128, intermediate_size=256,
                                            padded_vocab_size=256, vocab_size=256,
                                            block_size=64))
        return model, list(model.transformer.h), torch.randint(0, 256, (1, 8))
    if args.model == "llama2-4":
        import litgpt
        from litgpt.model import GPT
        model = GPT(litgpt.Config.from_name("Llama-2-7b-hf", n_layer=4, n_embd=256, n_head=4,
                                            n_query_groups=4, intermediate_size=1024,
                                            padded_vocab_size=512, vocab_size=512,
                                            block_size=128))
        return model, list(model.transformer.h), torch.randint(0, 512, (1, 64))
    if args.model in ("tiny", "one-op"):
        model = Tiny() if args.model == "tiny" else OneOp()
        return model, [model], torch.randn(4, 8)
    from keraunos.testing.vision import import_torchvision
    model = getattr(import_torchvision().models, args.model)()
    if hasattr(model, "features"):  # mobilenet, efficientnet: a Sequential of stages
        blocks = list(model.features)
    else:  # resnet: its residual blocks
        blocks = [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                  for block in layer]
    return model, blocks, torch.randn(2, 3, 64, 64)


def child(system: str, args) -> dict:
    import keraunos
    torch.set_num_threads(1)
    model, blocks, x = build(args)
    model.train(args.train).to(args.device)
    x = x.to(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    start = time.perf_counter()
    if system == "eager":
        run = model
    elif system.startswith("keraunos"):
        fuse = {"keraunos": "background", "keraunos-alone": "background",
                "keraunos-nostore": "background", "keraunos-wait": "wait",
                "keraunos-torch": "off"}[system]
        run = keraunos.jit(model, fuse=fuse)
    elif system in ("regional", "regional-async"):
        for block in blocks:
            block.compile()
        run = model
    else:
        run = torch.compile(model)
    if args.train:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def call():
            optimizer.zero_grad(set_to_none=True)
            run(x).float().square().mean().backward()
            optimizer.step()
            sync()
    else:
        def call():
            with torch.no_grad():
                run(x)
            sync()
    call()
    first = time.perf_counter() - start
    if system in ("keraunos", "keraunos-alone", "keraunos-nostore"):
        keraunos.wait_for_fusion(run)
    elif system == "regional-async":
        _call_until_compiled(call)
    fused = time.perf_counter() - start
    for _ in range(5):
        call()
    samples = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return {"first": first, "fused": fused, "call": statistics.median(samples)}


def _call_until_compiled(call) -> None:
    """Calls until a call runs no graph eagerly (async+subprocess: every block's compiled graph
    arrived), as a program that keeps calling would."""
    from torch._inductor.compile_fx_async import _AsyncFxCompile
    deadline = time.perf_counter() + ASYNC_WAIT_S
    while time.perf_counter() < deadline:
        before = _AsyncFxCompile._stat_eager_runs
        call()
        if _AsyncFxCompile._stat_eager_runs == before:
            return
    raise RuntimeError(f"async+subprocess: calls still ran eagerly after {ASYNC_WAIT_S} s")


def _child_argv(args) -> list[str]:
    argv = ["--model", args.model, "--layers", str(args.layers), "--width", str(args.width),
            "--seq", str(args.seq), "--calls", str(args.calls), "--device", args.device]
    return argv + (["--train"] if args.train else [])


def measure(system: str, args, cache_dir: str) -> dict | None:
    # keraunos's store goes with Inductor's cache: a cold run finds neither (it keeps which ISA
    # test libraries load and each region's compiled module), a restart finds both.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "KERAUNOS_FUSE": "",
           "KERAUNOS_CACHE_DIR": os.path.join(cache_dir, "keraunos-store")}
    if system == "keraunos-alone":  # the default without the compile helpers
        env["KERAUNOS_COMPILE_WORKERS"] = "0"
    if system == "keraunos-nostore":  # the default without the program store: a restart captures
        env["KERAUNOS_PROGRAM_STORE"] = "0"
    if system == "regional-async":
        env["TORCHINDUCTOR_FX_COMPILE_MODE"] = "async+subprocess"
        # With the FX graph cache on, torch 2.13's async mode raises on every cache miss
        # (NotImplementedError: _AsyncOutputCode.set_triton_bundle): it runs with the cache off.
        env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", system,
                           *_child_argv(args)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"  {system} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_all(args) -> dict:
    """system -> {column: seconds}, or None where the system failed."""
    rows = {}
    for system in args.systems.split(","):
        with tempfile.TemporaryDirectory(prefix="keraunos-tiers-") as cache_dir:
            cold = measure(system, args, cache_dir)
            warm = measure(system, args, cache_dir) if cold else None
        rows[system] = warm and {"first": cold["first"], "fused": cold["fused"],
                                 "restart first": warm["first"], "restart fused": warm["fused"],
                                 "call": warm["call"]}
        print(f"  measured {system}", file=sys.stderr, flush=True)
    return rows


def _anchor(rows: dict):
    """(the row ratios are to, its name): regional torch.compile's, else whole-model's."""
    for system, name in (("regional", "regional torch.compile"), ("compile", "torch.compile")):
        if rows.get(system) is not None:
            return rows[system], name
    return None, None


def table(rows: dict, title: str) -> str:
    anchor, anchor_name = _anchor(rows)
    lines = [title, f"{'system':<16}" + "".join(f"{label:>20}" for _, label in COLUMNS)
             + (f"   (ratios to {anchor_name})" if anchor else "")]
    for system, row in rows.items():
        if row is None:
            lines.append(f"{system:<16}{'failed (see above)':>20}")
            continue
        cells = []
        for key, _ in COLUMNS:
            if system in NEVER_FUSED and "fused" in key:
                cells.append(f"{'-':>20}")
                continue
            value = f"{row[key] * 1e3:.1f} ms" if key == "call" else f"{row[key]:.2f} s"
            ratio = f" ({row[key] / anchor[key]:.2f}x)" if anchor else ""
            cells.append(f"{value + ratio:>20}")
        lines.append(f"{system:<16}" + "".join(cells))
    return "\n".join(lines)


def json_table(rows: dict) -> dict:
    """The table as benchmarks/report.py renders it: columns, and one row of cells per system."""
    anchor, anchor_name = _anchor(rows)
    table_rows = []
    for system, row in rows.items():
        if row is None:
            table_rows.append([system] + ["failed"] * len(COLUMNS))
            continue
        cells = [system]
        for key, _ in COLUMNS:
            if system in NEVER_FUSED and "fused" in key:
                cells.append("-")
                continue
            value = f"{row[key] * 1e3:.1f} ms" if key == "call" else f"{row[key]:.2f} s"
            cells.append(value + (f" ({row[key] / anchor[key]:.2f}x)" if anchor else ""))
        table_rows.append(cells)
    columns = ["system"] + [label for _, label in COLUMNS]
    return {"tables": [{"columns": columns, "rows": table_rows,
                        "ratios_to": anchor_name or ""}]}


def write_json(rows: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(json_table(rows), f, indent=1)


def chart(rows: dict, title: str, path: str) -> bool:
    """Bars of each system's columns as ratios to regional torch.compile's (or whole-model's)."""
    anchor, anchor_name = _anchor(rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: it needs matplotlib (the bench extra)", file=sys.stderr)
        return False
    if anchor is None:
        print("no chart: it draws ratios to torch.compile; add regional or compile to --systems",
              file=sys.stderr)
        return False
    measured = [(s, r) for s, r in rows.items() if r is not None]
    figure, axes = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(measured)
    for i, (system, row) in enumerate(measured):
        axes.bar([c + i * width for c in range(len(COLUMNS))],
                 [float("nan") if system in NEVER_FUSED and "fused" in key
                  else row[key] / anchor[key] for key, _ in COLUMNS], width, label=system)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([c + 0.4 - width / 2 for c in range(len(COLUMNS))],
                    [label for _, label in COLUMNS])
    axes.set_ylabel(f"time / {anchor_name}'s (lower is better)")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keraunos bench tiers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--train", action="store_true", help="time a training step")
    parser.add_argument("--layers", type=int, default=8, help="gpt only")
    parser.add_argument("--width", type=int, default=128, help="gpt only")
    parser.add_argument("--seq", type=int, default=32, help="gpt only")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--chart", default="", help="also draw a PNG chart here")
    parser.add_argument("--json", default="", help="also write the table to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="3 calls: proves every path runs, measures nothing")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.calls = 3
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.model in LITGPT_MODELS and importlib.util.find_spec("litgpt") is None:
        print(f"keraunos bench tiers: --model {args.model} builds a litgpt model, and litgpt is "
              "not installed: pip install 'keraunos[bench]'", file=sys.stderr)
        return 2
    shape = (f"{args.layers} layers, width {args.width}, (1, {args.seq})" if args.model == "gpt"
             else "")
    title = (f"{args.model} {shape} {'training step' if args.train else 'no_grad'} on "
             f"{args.device}, 1 thread; "
             f"each system cold in its own process, then a restart on the same cache dir")
    rows = measure_all(args)
    print(table(rows, title))
    if args.json:
        write_json(rows, args.json)
    if args.chart and chart(rows, title, args.chart):
        print(f"chart written to {args.chart}")
    return 0 if all(row is not None for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
