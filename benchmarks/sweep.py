"""Every model of transformers' catalogue under keraunos and torch.compile, against float64.

Run: python benchmarks/sweep.py [--only llama,bert] [--shard I/N] [--limit N] [--timeout S]
         [--systems keraunos,torch.compile] [--out benchmarks/results/sweep_transformers.jsonl]
     python benchmarks/sweep.py --suite timm [--per-family N] [...]
    python benchmarks/sweep.py --table [--out ...]
    python benchmarks/sweep.py --doc docs/models.md

Each model type transformers' auto-config knows is built small from its config class with random
weights (``keraunos/testing/catalogue.py``: the shrinking, the head, the inputs), and each
system runs it in a process of its own with a time limit. In that process: a float64 run and an
eager float32 run (eval forward on two inputs, two SGD training steps), then the system on a
copy of the model, each value judged against float64: at most three times eager float32's own
error. A row per model is
appended to the output file as it finishes, so a run can stop and go on (models already there are
skipped), and shards (``--shard 0/4`` ... ``3/4``) can run side by side into files of their own.

A model whose build or eager run fails is listed, not counted: the recipe, not the system, did not
fit it. ``--suite timm`` runs one model (``--per-family``) of each of timm's families instead
(timm and torchvision from ``.venv/vendor`` beside the CPU torch 2.13: scripts/setup.sh).
``--table`` prints the markdown table and the pass rates of what a file holds; ``--doc PATH``
writes a page of every ``benchmarks/results/sweep_*.jsonl``, with the commit, date and versions.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "sweep_transformers.jsonl"
DEFAULT_SYSTEMS = ("keraunos", "torch.compile")
BACKEND = "keraunos backend"  # torch.compile(model, backend="keraunos")


def child(model_type: str, systems: list[str]) -> dict:
    """One model, in this process: its row."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from keraunos.testing import catalogue
    torch.set_num_threads(1)
    row: dict = {"model_type": model_type, "torch": torch.__version__.split("+")[0]}
    if model_type.startswith("timm:"):
        timm = _import_timm()
        row["timm"] = timm.__version__
    else:
        import transformers
        row["transformers"] = transformers.__version__
    try:
        built = catalogue.build_timm(model_type[len("timm:"):]) \
            if model_type.startswith("timm:") else catalogue.build(model_type)
        built.inputs(0, True)
    except Exception as e:  # noqa: BLE001 - the recipe does not fit this model type
        row["build"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        return row
    row["head"] = built.head
    try:
        reference_model = copy.deepcopy(built.model).double()
        catalogue.float64_ready(reference_model)
        reference = catalogue.run(reference_model, reference_model, built.inputs, torch.float64)
        eager_model = copy.deepcopy(built.model)
        start = time.perf_counter()
        eager = catalogue.run(eager_model, eager_model, built.inputs)
        row["eager_seconds"] = round(time.perf_counter() - start, 3)
    except Exception as e:  # noqa: BLE001 - eager itself fails with this recipe
        row["eager"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        return row
    for system in systems:
        outcome = catalogue.check(built, system, eager, reference)
        row[system] = dataclasses.asdict(outcome)
        row[system]["seconds"] = round(outcome.seconds, 3)
    return row


def _import_timm():
    """timm, which imports torchvision: beside the CPU torch 2.13, both from ``.venv/vendor``
    (``keraunos.testing.vision``; ``pip install --no-deps --target .venv/vendor timm``)."""
    from keraunos.testing.vision import import_torchvision
    import_torchvision()
    import timm
    return timm


def _done(out: pathlib.Path) -> set[str]:
    if not out.exists():
        return set()
    return {json.loads(line)["model_type"] for line in out.read_text().splitlines() if line}


def sweep(args) -> None:
    from keraunos.testing import catalogue
    if args.only:
        types = args.only.split(",")
    elif args.suite == "timm":
        _import_timm()
        types = catalogue.timm_models(args.per_family)
    else:
        types = catalogue.model_types()
    index, count = (int(x) for x in args.shard.split("/"))
    types = [t for i, t in enumerate(types) if i % count == index]
    done = _done(args.out)
    todo = [t for t in types if t not in done][:args.limit or None]
    print(f"sweep: {len(todo)} model types to run ({len(done)} already in {args.out})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    commit = _commit()
    for n, model_type in enumerate(todo, 1):
        row = {**_row(model_type, args.systems, args.timeout), "commit": commit}
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{n}/{len(todo)}] {model_type}: {_summary(row, args.systems)}", flush=True)


def _commit() -> str:
    root = pathlib.Path(__file__).parent.parent
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=root).stdout.strip()


def _row(model_type: str, systems: list[str], timeout: float) -> dict:
    """A model's row: each system in a process of its own, with its own time limit (a system
    that runs out of time or memory loses its own result, not the others'); the float64 and
    eager runs are made again in each."""
    row: dict = {}
    for system in systems:
        one = _run_child(model_type, [system], timeout)
        if "crashed" in one:  # the process died (out of memory): this system's outcome
            one = {"model_type": model_type,
                   system: {"status": "crashed", "detail": one.pop("crashed")}}
        row = {**one, **row}  # the first system's common fields (head, eager time) stay
        if "build" in one or "eager" in one:  # the recipe does not fit: no system is tried
            return one
    return row


def _run_child(model_type: str, systems: list[str], timeout: float) -> dict:
    command = [sys.executable, __file__, "--child", model_type, "--systems", ",".join(systems)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type,
                **{s: {"status": "timeout", "detail": f"over {timeout:.0f} s"} for s in systems}}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:240]
        return {"model_type": model_type, "crashed": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def _summary(row: dict, systems) -> str:
    for reason in ("build", "eager", "crashed"):
        if reason in row:
            return f"{reason} failed: {row[reason][:100]}"
    return ", ".join(f"{s} {row[s]['status']}" for s in systems if s in row)


def _systems_of(rows: list[dict]) -> list[str]:
    """The systems a results file ran, in the catalogue's order."""
    from keraunos.testing import catalogue
    return [s for s in catalogue.SYSTEMS if any(s in r for r in rows)]


def table(out: pathlib.Path, systems=None) -> str:
    """The markdown table of a results file, and each system's pass rates (of ``systems``, by
    default those the file holds)."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line]
    systems = systems or _systems_of(rows)
    ran = [r for r in rows if all(s in r for s in systems)]
    ours = next(s for s in systems if s.startswith("keraunos"))
    timed = "torch.compile" in systems  # a time ratio needs both
    lines = ["| model type | head | " + " | ".join(systems) + f" | {ours} route |"
             + (f" time to result, {ours} / torch.compile |" if timed else ""),
             "|---|---|" + "---|" * len(systems) + "---|" + ("---|" if timed else "")]
    for r in sorted(ran, key=lambda r: r["model_type"]):
        cells = [_cell(r[s]) for s in systems]
        k, c = r.get(ours, {}), r.get("torch.compile", {})
        ratio = f"{k['seconds'] / c['seconds']:.2f}" if k.get("seconds") and c.get("seconds") \
            else ""
        lines.append(f"| {r['model_type']} | {r.get('head', '')} | " + " | ".join(cells)
                     + f" | {k.get('route', '')} |" + (f" {ratio} |" if timed else ""))
    lines.append("")
    for s in systems:
        statuses = [r[s]["status"] for r in ran]
        counts = {k: statuses.count(k) for k in sorted(set(statuses))}
        lines.append(f"- {s}: {counts.get('pass', 0)}/{len(ran)} pass "
                     f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
    both = [r["keraunos"]["seconds"] / r["torch.compile"]["seconds"] for r in ran
            if r.get("keraunos", {}).get("status") == "pass"
            and r.get("torch.compile", {}).get("status") == "pass"
            and r["torch.compile"].get("seconds")]
    if both:
        mean = math.exp(sum(math.log(x) for x in both) / len(both))
        lines.append(f"- time to a checked result, keraunos / torch.compile: {mean:.2f}x "
                     f"(geometric mean over the {len(both)} models both pass)")
    own = sum(1 for r in ran if r.get(ours, {}).get("route") in ("own capture",
                                                                   "every graph compiled"))
    if ran:
        lines.append(f"- {ours}, on its own capture: {own}/{len(ran)}" if ours != BACKEND else
                     f"- {ours}, every Dynamo graph compiled by keraunos: {own}/{len(ran)}")
    unjudged = [sum(r[s].get("worst", {}).get("not judged", 0) for s in systems) for r in ran]
    if any(unjudged):
        lines.append(f"- values not judged (eager float32's own error larger than the value): "
                     f"{sum(unjudged)}, in {sum(1 for n in unjudged if n)} models")
    skipped = len(rows) - len(ran)
    lines.append(f"- not counted: {skipped} model types whose build or eager run failed with "
                 f"this recipe")
    return "\n".join(lines)


def page(outs: list[pathlib.Path]) -> str:
    """docs/models.md: how the sweep was run, on what, and a table per results file."""
    root = pathlib.Path(__file__).parent.parent
    commit = _commit()
    libraries = []
    for out in outs:
        text = out.read_text()
        libraries.append("timm's families" if '"timm"' in text else "transformers' catalogue")
    libraries = list(dict.fromkeys(libraries))
    lines = [
        f"# Every model: {' and '.join(libraries)}, under keraunos and torch.compile",
        "",
        "Generated by `python benchmarks/sweep.py --doc docs/models.md` from the results files "
        f"named below, at commit {commit} ({time.strftime('%Y-%m-%d')}); each section names the "
        "command and the commit that measured it. On the CPU, one intra-op thread per model, "
        "each model under each system in a process of its own with a time limit (300 or 600 s: "
        "a timeout's cell names it); a process that dies (out of memory) is that system's "
        "crash.",
        "",
        "A transformers model type is built small from its config class with random weights "
        "(widths 32, 2 layers, 4 heads, vocabulary 128, images 32 px, dropout off, one block a "
        "stage with a power of two of heads; the first "
        "head of causal LM, masked LM, seq2seq, image or sequence classification, else the bare "
        "model: `keraunos/testing/catalogue.py`); a timm family is its smallest model, 10 "
        "classes, dropout and stochastic depth off, on the smallest of 64, 96 and 128 px images "
        "it runs on in eager (else its own size); every run starts from the same seed. Each "
        "system runs an eval forward on two "
        "inputs and two SGD training steps; every output and every gradient is compared with a "
        "float64 run of the same model and passes when its error is at most three times eager "
        "float32's (plus a floor of 1e-6 of the step's largest value, for values that are zero "
        "in exact arithmetic); a value that eager float32 itself gets wrong by more than its own "
        "size (a BatchNorm over two values per channel, after a step) is counted as not judged, "
        "for every system. keraunos runs with its defaults (`keraunos.jit(model)`: fused "
        "tier in the background, the Dynamo route for what its own capture refuses); the route "
        "column says which served. Time to result is each system's wall time for the whole "
        "check, compile included.",
        "",
    ]
    for out in outs:
        rows = [json.loads(line) for line in out.read_text().splitlines() if line]
        library = "timm" if any("timm" in r for r in rows) else "transformers"
        systems = _systems_of(rows)
        versions = sorted({(r.get("torch"), r.get(library)) for r in rows if r.get("torch")})
        on = ", ".join(f"torch {t} with {library} {v}" for t, v in versions)
        suite = " --suite timm" if library == "timm" else ""
        commits = sorted({r["commit"] for r in rows if r.get("commit")})
        at = f"at commit {', '.join(commits)}" if commits else "commit not recorded"
        if systems == [BACKEND]:
            lines += [f"## {library}, through `torch.compile(model, backend=\"keraunos\")`", "",
                      "Dynamo captures the model's graphs and keraunos compiles each (a graph it "
                      "cannot compile runs as Dynamo captured it, with a warning: the route "
                      "column counts them). The models the section above ran, judged as it "
                      "judges them.", "",
                      f"`python benchmarks/sweep.py{suite} --systems \"{BACKEND}\" --out "
                      f"{out.relative_to(root)} --only` the model types the section above "
                      f"counted when it started, in its order, on {on}, {at}: {len(rows)} model "
                      f"types.", "",
                      table(out), ""]
            continue
        if systems == ["keraunos fused"]:
            names = ",".join(r["model_type"] for r in rows)
            lines += [f"## {library}, on the fused program", "",
                      "`keraunos.jit(model, fuse=\"wait\")`: every call, the first included, "
                      "runs the fused program (Inductor's regions), where the defaults run the "
                      "first calls on eager's kernels while the regions compile. The models with "
                      "the deepest BatchNorm stacks, and others with BatchNorm, as the section "
                      "above judges them. Of the rows marked wrong, those looked into (dla34, "
                      "inception_resnet_v2) differ from float64 at one or two elements each: a "
                      "BatchNorm output within float32's rounding of zero, on the other side of "
                      "the ReLU after it than in float64 (one channel's bias gradient off by "
                      "10-35%, and every gradient before it); eager float32 happened to fall on "
                      "float64's side. A batch of 2 leaves 2 to 8 values per channel in the last "
                      "blocks, where such ties decide the most.", "",
                      f"`python benchmarks/sweep.py --systems \"keraunos fused\" --out "
                      f"{out.relative_to(root)} --only {names}`, on {on}, {at}.", "",
                      table(out), ""]
            continue
        lines += [f"## {library}", "",
                  f"`python benchmarks/sweep.py{suite} --out {out.relative_to(root)}` "
                  f"(sharded with `--shard I/N`), on {on}, {at}: {len(rows)} model types, in "
                  f"the catalogue's own order (a run not finished covers its start).", "",
                  table(out, systems), ""]
    return "\n".join(lines)


def _cell(outcome: dict) -> str:
    status = outcome["status"]
    if status == "pass":
        return "pass"
    detail = outcome.get("detail") or (outcome.get("worst") or {}).get("value", "")
    return f"{status}: {detail[:80]}".replace("|", "/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--suite", choices=("transformers", "timm"), default="transformers")
    parser.add_argument("--per-family", type=int, default=1)
    parser.add_argument("--only", default="")
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--doc", type=pathlib.Path)
    args = parser.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    if args.child:
        print(json.dumps(child(args.child, args.systems)))
    elif args.doc:
        outs = sorted(RESULTS.glob("sweep_*.jsonl")) if args.out == DEFAULT_OUT else [args.out]
        args.doc.write_text(page(outs))
    elif args.table:
        print(table(args.out, args.systems))
    else:
        sweep(args)


if __name__ == "__main__":
    main()
