"""Instructions per call, counted by callgrind: a figure this shared machine's load cannot move.

Run: python benchmarks/instructions.py [--case litgpt-decode | tiny | mlp | mlp-grad |
     MODEL:infer | MODEL:train]
     [--systems fused,inductor] [--calls N] [--keep] [--cache-sim]

Wall time on a shared two-core machine moves by 2x between runs, which cannot settle a 1.1x
target; the number of instructions a call executes moves by well under 1 %. This script runs
itself under ``valgrind --tool=callgrind --instr-atstart=no``: the child compiles and warms up each
system uninstrumented, then the parent switches instrumentation on (``callgrind_control -i on``)
for exactly ``--calls`` calls and dumps the counts (``-d``). C++ kernels, the Python interpreter
and the framework around them are all counted, so what a row says is the whole cost of a warm call.

Cases: ``tiny``, ``mlp``, ``mlp-grad`` (the per-call overhead cases: ``(x * 2 + 1).relu()`` on a
(4,) tensor; an 8-16-8 MLP under ``no_grad`` and in grad mode), ``symbolic``
(``gelu(x @ y + 1).sum(-1)``, x 4x8: systems ``jit``, a static entry, and ``jit-dynamic``, a
symbolic one made by a second shape; ``eager``), ``decode`` (``overhead.py``'s
decode step, fixed shapes; systems eager, jit, backend, inductor, dynamo), ``litgpt-decode`` (a decode step of litgpt's KV-cache GPT under ``inference_mode``, the
cache position moving each call), ``MODEL:infer`` and ``MODEL:train`` for a zoo model
(``keraunos.testing.zoo``: eval and no_grad with the padding mask; a train-mode AdamW step).
Systems: ``eager``, ``jit`` (keraunos.jit), ``fused`` (the inductor executor: keraunos.jit for
litgpt-decode, the backend with fusion for zoo models and the small cases), ``jit-fused``
(small cases: keraunos.jit with the inductor executor, fuse="wait"), ``backend``
(torch.compile with backend="keraunos", its background fusion waited for), ``dynamo``
(torch.compile with backend="eager": Dynamo's own cost), ``inductor`` (torch.compile). Ratios
are to the last system listed. ``--keep`` keeps callgrind's files for callgrind_annotate;
``--cache-sim`` also counts simulated cache misses and mispredicted branches per call.
Needs valgrind (``apt-get install valgrind``); a run of two systems takes minutes (valgrind runs
the compilations too, uninstrumented, at about a tenth of their speed).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch the network
# The keraunos of this checkout (a git worktree too), not whichever one is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FUSED = ["inductor", "torch"]


def _wait(path: str, child: subprocess.Popen | None = None) -> None:
    while not os.path.exists(path):
        if child is not None and child.poll() is not None:
            raise SystemExit(f"the instrumented child exited ({child.returncode}) before {path}")
        time.sleep(0.1)


def _touch(path: str) -> None:
    open(path, "w").close()


def _litgpt_step(label: str):
    """A decode step of litgpt's KV-cache GPT: (step function, label)."""
    import torch
    from litgpt.generate.base import generate

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from generate import litgpt_model

    import keraunos
    makers = {"eager": lambda m: m, "jit": lambda m: keraunos.jit(m, fuse="off"),
              "fused": lambda m: keraunos.jit(m, executors=FUSED, fuse="wait"),
              "backend": lambda m: torch.compile(m, backend="keraunos"),
              "dynamo": lambda m: torch.compile(m, backend="eager"), "inductor": torch.compile}
    if label not in makers:
        raise SystemExit(f"litgpt-decode has no system {label!r}: {sorted(makers)}")
    module = litgpt_model()
    model = makers[label](module)
    module.max_seq_length = 256
    module.set_kv_cache(batch_size=1)
    prompt = torch.randint(0, 128, (7,))
    generate(model, prompt, 7 + 16, temperature=0.0, top_k=1)
    module.set_kv_cache(batch_size=1)
    with torch.inference_mode():
        generate(model, prompt, 8, temperature=0.0, top_k=1)
    if label == "backend":  # its fused tier comes from the background: count that one
        from keraunos.dynamo.backend import subgraphs_of
        for subgraph in subgraphs_of(model):
            keraunos.wait_for_fusion(subgraph.jitted)
    token, position = torch.tensor([[5]]), [9]

    @torch.inference_mode()
    def step():
        pos = position[0] % 200 + 9
        model(token, input_pos=torch.tensor([pos]), input_pos_maxp1=pos + 1)
        position[0] += 1
    return step


def _zoo_step(name: str, mode: str, label: str):
    import torch

    import keraunos
    import keraunos.dynamo
    from keraunos.testing.zoo import inputs_of, make_models
    torch._dynamo.reset()
    base, _ = make_models(name)
    model = copy.deepcopy(base)
    make = {"eager": lambda m: m, "jit": lambda m: keraunos.jit(m, fuse="off"),
            "backend": lambda m: torch.compile(m, backend="keraunos"),
            "fused": lambda m: torch.compile(m, backend=keraunos.dynamo.backend(executors=FUSED, fuse="wait")),
            "inductor": torch.compile}[label]
    if mode == "train":
        model.train()
        kwargs = inputs_of(name, seed=3, mask=False, labels=True)
        run = make(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            run(**kwargs).loss.backward()
            optimizer.step()
        return step
    model.eval()
    kwargs = inputs_of(name, seed=1, mask=True, labels=False)
    run = make(model)

    def step():
        with torch.no_grad():
            run(**kwargs)
    return step


def _decode_step(label: str):
    """``overhead.py``'s decode step (fixed shapes: ``input_pos_maxp1`` left None), under the
    same systems as its part "calls" (``jit`` is its ``keraunos.jit``)."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead
    torch._dynamo.reset()
    step, run = overhead.decode_program(overhead.CALL_SYSTEMS[
        "keraunos.jit" if label == "jit" else label])
    step()
    overhead.wait_for_background_fusion(label, run)
    return step


SMALL_CASES = ("tiny", "mlp", "mlp-grad", "symbolic")


def _small_step(case: str, label: str):
    """The per-call cases of benchmarks/overhead.py: ``tiny`` is ``(x * 2 + 1).relu()`` on a (4,) tensor, ``mlp`` an
    8-16-8 MLP under ``no_grad`` and ``mlp-grad`` the same in grad mode (no backward)."""
    import torch

    import keraunos
    import keraunos.dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    if case == "symbolic":
        # A static entry (jit) against a symbolic one (jit-dynamic: a second shape made the
        # first dimension of x a symbol), the same call.
        def target(x, y):
            return torch.nn.functional.gelu(x @ y + 1).sum(-1)
        x, y = torch.randn(4, 8), torch.randn(8, 8)
        run = keraunos.jit(target, fuse="off") if label in ("jit", "jit-dynamic") else target
        if label == "jit-dynamic":
            run(x, y)
            run(torch.randn(5, 8), y)
            assert keraunos.cache_misses(run) == 2
        return lambda: run(x, y)
    if case == "tiny":
        def target(x):
            return (x * 2 + 1).relu()
        x = torch.randn(4)
    else:
        target = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                     torch.nn.Linear(16, 8))
        x = torch.randn(2, 8)
    make = {"eager": lambda m: m, "jit": lambda m: keraunos.jit(m, fuse="off"),
            "backend": lambda m: torch.compile(m, backend="keraunos"),
            "dynamo": lambda m: torch.compile(m, backend="eager"),
            "fused": lambda m: torch.compile(
                m, backend=keraunos.dynamo.backend(executors=FUSED, fuse="wait")),
            "jit-fused": lambda m: keraunos.jit(m, executors=FUSED, fuse="wait"),
            "inductor": torch.compile}[label]
    run = make(target)
    if label == "backend":  # its fused tier comes from the background: count that one
        from keraunos.dynamo.backend import subgraphs_of
        with torch.no_grad() if case == "mlp" else contextlib.nullcontext():
            run(x)
        for subgraph in subgraphs_of(run):
            keraunos.wait_for_fusion(subgraph.jitted)
    if case == "mlp":
        def step():
            with torch.no_grad():
                run(x)
        return step
    return lambda: run(x)


def child(case: str, systems: list[str], calls: int, directory: str) -> None:
    """Under valgrind: per system, build and warm up, then run ``calls`` calls between the
    parent's switches."""
    # Valgrind runs no AVX-512, which Inductor picks from /proc/cpuinfo and g++ from
    # -march=native: kernels are built for AVX2 here, as ATen's run under valgrind (set in the
    # environment: Inductor's config is thread-local, and keraunos fuses on a thread of its
    # own). keraunos's kernel store may hold kernels built outside valgrind: a store of its own.
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["TORCHINDUCTOR_CPP_MARCH"] = "x86-64-v3"
    os.environ["KERAUNOS_CACHE_DIR"] = f"{directory}/store"
    import torch
    import torch._inductor.config
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch._inductor.config.fallback_random = True  # a train step's dropout: eager's draws
    from keraunos.persist import programs
    from keraunos.runtime import native
    native.LOADER.start(wait=True)  # the native hit path, built first where it is not yet
    for label in systems:
        if case == "litgpt-decode":
            step = _litgpt_step(label)
        elif case == "decode":
            step = _decode_step(label)
        elif case in SMALL_CASES:
            step = _small_step(case, label)
        else:
            name, mode = case.split(":")
            step = _zoo_step(name, mode, label)
        for _ in range(3):
            step()
        # Work of keraunos's background thread for the warm-up's compilations (the program
        # store pickling what was captured) is done before the count: callgrind counts every
        # thread, and the count is of the calls alone.
        programs.wait_for_keeps()
        _touch(f"{directory}/ready-{label}")
        _wait(f"{directory}/go-{label}")
        for _ in range(calls):
            step()
        _touch(f"{directory}/done-{label}")
        _wait(f"{directory}/next-{label}")


def parent(case: str, systems: list[str], calls: int, keep: bool = False,
           cache_sim: bool = False) -> None:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"benchmarks/instructions.py needs {tool} (apt-get install valgrind)")
    directory = tempfile.mkdtemp(prefix="keraunos-instructions-")
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               *(["--cache-sim=yes", "--branch-sim=yes"] if cache_sim else []),
               f"--callgrind-out-file={directory}/cg.out", sys.executable,
               os.path.abspath(__file__), "--child", "--case", case, "--systems",
               ",".join(systems), "--calls", str(calls), "--dir", directory]
    with open(f"{directory}/log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        pid = str(process.pid)

        def control(*args):
            subprocess.run(["callgrind_control", *args, pid], check=True, capture_output=True)
        for label in systems:
            _wait(f"{directory}/ready-{label}", process)
            control("-i", "on")
            control("-z")
            _touch(f"{directory}/go-{label}")
            _wait(f"{directory}/done-{label}", process)
            control("-d", label)
            control("-i", "off")
            _touch(f"{directory}/next-{label}")
        if process.wait() != 0:
            raise SystemExit(f"the instrumented child failed; its output is in {directory}/log")
    counts, misses = {}, {}
    for file in os.listdir(directory):
        if not file.startswith("cg.out."):
            continue
        text = open(f"{directory}/{file}").read()
        trigger = re.search(r"^desc: Trigger: (.*)$", text, re.M)  # "dump fused"
        total = re.search(r"^(?:summary|totals): ([\d ]+)$", text, re.M)
        events = re.search(r"^events: (.*)$", text, re.M)
        if trigger and total and events:
            label = trigger.group(1).split()[-1]
            figures = dict(zip(events.group(1).split(), (int(n) for n in total.group(1).split())))
            counts[label] = figures["Ir"] / calls
            if "D1mr" in figures:  # --cache-sim (and --branch-sim)
                misses[label] = tuple(sum(figures[e] for e in kinds) / calls for kinds in (
                    ("I1mr", "D1mr", "D1mw"), ("ILmr", "DLmr", "DLmw"), ("Bcm", "Bim")))
    reference = counts.get(systems[-1])
    print(f"{case}: instructions per call, {calls} warm calls, one thread (callgrind)")
    for label in systems:
        if label not in counts:
            print(f"  {label:10s} (no count: see {directory}/log)")
            continue
        ratio = f"{counts[label] / reference:.3f}x {systems[-1]}" if reference else ""
        line = f"  {label:10s} {counts[label] / 1e3:12,.1f}k  {ratio}"
        if label in misses:
            line += (f"   L1 misses {misses[label][0] / 1e3:,.2f}k, last-level misses "
                     f"{misses[label][1] / 1e3:,.2f}k, mispredicted branches "
                     f"{misses[label][2] / 1e3:,.2f}k (callgrind's models)")
        print(line)
    if keep:
        print(f"callgrind's files (callgrind_annotate --inclusive=yes FILE): {directory}")
    elif len(counts) == len(systems):
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="litgpt-decode",
                        help="litgpt-decode, or MODEL:infer / MODEL:train for a zoo model")
    parser.add_argument("--systems", default="fused,inductor",
                        help="comma-separated: eager, jit, fused, backend, inductor; "
                        "dynamo (torch.compile(backend='eager'), small cases only)")
    parser.add_argument("--calls", type=int, default=20, help="instrumented calls per system")
    parser.add_argument("--keep", action="store_true",
                        help="keep callgrind's output files (per function: callgrind_annotate)")
    parser.add_argument("--cache-sim", action="store_true",
                        help="also count simulated cache misses and mispredicted branches "
                        "(callgrind's --cache-sim=yes --branch-sim=yes; its last level is the "
                        "host's, set another with VALGRIND_OPTS='--LL=2097152,16,64')")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    systems = args.systems.split(",")
    if args.case not in ("litgpt-decode", "decode", *SMALL_CASES) and (
            ":" not in args.case or args.case.split(":")[1] not in ("infer", "train")):
        parser.error(f"--case is litgpt-decode, {', '.join(SMALL_CASES)}, MODEL:infer or MODEL:train")
    if args.child:
        child(args.case, systems, args.calls, args.dir)
    else:
        parent(args.case, systems, args.calls, args.keep, args.cache_sim)


if __name__ == "__main__":
    main()
