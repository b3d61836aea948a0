"""docs/benchmarks.md, its chart and README.md's headline table, rendered from the stored results.

Run: ``python benchmarks/report.py`` renders docs/benchmarks.md, docs/benchmarks_headline.png
and the headline table of README.md from ``benchmarks/results/<family>.json``;
``python benchmarks/report.py --run`` first measures every family again by running the benchmark
scripts (each with ``--json``), and stores what they measured there. ``--families tiers,train``
measures only those; ``--quick`` passes ``--quick`` to every script (every path runs, nothing is
measured) and, unless ``--results``/``--output`` say otherwise, writes into a temporary folder so
that the stored figures stay as they are.

A results file holds one family: its runs, each with the command that printed it, the commit and
date it was measured on, the machine, and its tables (columns, then rows whose first cell names
the row). What a family measures and how is written here (``FAMILIES``), so a new measurement
changes figures, never prose.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUTPUT = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "benchmarks_headline.png"
README = ROOT / "README.md"
HEADLINE_START = "<!-- headline figures: rendered by benchmarks/report.py -->"
HEADLINE_END = "<!-- end of the headline figures -->"


@dataclasses.dataclass
class Family:
    name: str  # benchmarks/results/<name>.json
    title: str
    about: str  # what is measured and how, in markdown
    runs: list[list[str]]  # the script and its arguments, from the repository root, per run
    merge: bool = False  # the runs' tables as one table (rows prefixed with the run's label)


@dataclasses.dataclass
class Headline:
    family: str
    caption: str  # the table whose caption starts so ("" for any table of the family)
    row: str  # the row whose first cell starts so
    column: str
    label: str
    against: str


TIERS = ["benchmarks/tiers.py", "--systems", "keraunos,regional"]
VISION_TIERS = ["benchmarks/tiers.py", "--calls", "10", "--systems", "keraunos,compile"]
FAMILIES = [
    Family("tiers", "Tiers: first result, time until fused, restart, per call", """\
`keraunos.jit` answers the first call on the torch executor (eager's kernels) while helper
processes compile the fused program; the switch happens between two calls once every region is
ready. Each system runs cold in its own process (empty Inductor cache and keraunos store), then
again in a second process on the caches the first left (the restart). Columns: time from the jit
call to the first result; time until every call runs fused (`keraunos.wait_for_fusion`
returns; for `torch.compile`, its first call); the same two after the restart; the median per
call once fused. Ratios are to regional `torch.compile` (each repeated block compiled, as
torch's docs recommend) or, for torchvision, whole-model `torch.compile`, in the same run.""",
           [TIERS + ["--model", "llama32", "--calls", "30"],
            TIERS + ["--model", "llama2-4", "--train", "--calls", "20"]]),
    Family("tiers_torchvision", "Tiers on torchvision's convnets", """\
The same measure on torchvision's models (random weights, a batch of 2 images of 64x64), eval
(`no_grad`) and a training step (forward, loss, backward, SGD step), against whole-model
`torch.compile`. Per call on these models is better measured in turns in one process: see the
model zoo's torchvision table.""",
           [VISION_TIERS + ["--model", m] + t
            for m in ("resnet18", "mobilenet_v3_small", "efficientnet_b0")
            for t in ([], ["--train"])], merge=True),
    Family("overhead", "Per-call overhead", """\
What a warm call costs on small programs, where the framework's own time shows: the systems in
turns, blocks of 25 calls each, the order rotating every round; each cell the median time per
call and its ratio to eager. `keraunos.jit` runs the torch executor here (`fuse="off"`); the
backend is `torch.compile(m, backend="keraunos")`, `inductor` is `torch.compile(m)`, `dynamo`
is `torch.compile(m, backend="eager")` (Dynamo's own cost). Programs: `tiny` is
`(x * 2 + 1).relu()` on 4 floats; `mlp` is Linear(8, 16), ReLU, Linear(16, 8) under `no_grad`;
`mlp-grad` the same in grad mode; `decode` one decode step of a 2-layer litgpt KV-cache GPT.""",
           [["benchmarks/overhead.py", "--only", "calls", "--calls", "4000"]]),
    Family("fusion", "Fusion: `keraunos bench`", """\
`keraunos bench` (`benchmarks/fusion.py`): three litgpt workloads, each system in a process of
its own with an empty Inductor cache. (a) the 32-layer Llama-3-8B layout at tiny widths, input
(1, 8), `no_grad`: overhead-bound; (b) a 4-layer Llama-2 config at width 1024, batch 4x128,
`no_grad`: compute-bound; (c) a training step (forward, backward, AdamW) of a 4-layer model at
width 256. `keraunos` is the torch executor, `keraunos+inductor` the fused program. Compile +
warm-up by the 2N method (the first N calls' time minus the last N's); per call the median of
the last N; peak memory the process's `ru_maxrss`; saved, the bytes one forward keeps for the
backward.""",
           [["benchmarks/fusion.py", "--workloads", "a,b,c", "--chart", ""]]),
    Family("train", "Training step", """\
`benchmarks/train.py`: forward, loss, backward and AdamW step of a 4-layer litgpt Llama-2 config
(width 256, batch 1x64). `keraunos` is the torch executor, `keraunos fused` the fused program
(`fuse="wait"`, the program the default switches to), `regional` is `block.compile()` per layer;
steps timed in turns, medians. `keraunos step` is `keraunos.jit(train_step)`: `zero_grad`, forward,
loss, `loss.backward()` and AdamW as one program (`keraunos step fused`: fused), beside torch's
best optimizer recipes: `torch.compile(optimizer.step)`, `AdamW(fused=True)` (torch's fused
kernel); `..., cosine lr`: the step also steps a `CosineAnnealingLR` (a float rate that changes
on every step).""",
           [["benchmarks/train.py", "--iters", "20", "--whole-step"]]),
    Family("precision", "Reduced precision", """\
`benchmarks/precision.py`: a 4-layer, 512-wide litgpt Llama-2 config, batch (2, 64), as a float32
model under `torch.autocast("cpu", dtype=torch.bfloat16)` and as a bfloat16 model; an eval forward
(`no_grad`) and a training step (float32 loss, backward, AdamW; `torch.compile(model)` with eager
AdamW). `keraunos` is its fused program (`fuse="wait"`): `keraunos.jit(model)`, and for the step
cases `keraunos.jit(train_step)`, the whole step as one program; systems in turns, medians. The
last column: distance from a float64 run (logits, or every gradient of one step), vs eager's.""",
           [["benchmarks/precision.py"]]),
    Family("generate", "Text generation and symbolic sizes", """\
`benchmarks/generate.py`: greedy generation with tiny random-weight configs (Hugging Face
models through their own `generate`, litgpt through its `generate()`), per token = one decode
step, measured after every prompt length was generated once; the systems in turns. `compiles
per prompt` lists the compilations of each prompt length's first `generate` (sizes that vary
become symbols, so a second prompt length compiles little or nothing); `tokens` says whether
every generated sequence equals eager's.""",
           [["benchmarks/generate.py", "--models", "litgpt,llama,mistral,qwen2,gpt2",
             "--fusion", "--tokens", "16", "--prompts", "7,11", "--repeats", "3"]]),
    Family("distributed", "Distributed training steps", """\
`benchmarks/distributed.py`: 2 gloo ranks on one machine, one intra-op thread each, a 4-layer
litgpt GPT (width 128) trained with SGD; systems in turns, medians of rank 0's step times,
every system's losses compared with eager's. On CPU with gloo this measures overheads only: the
"communication" is a copy between two local processes on the same cores the backward uses.""",
           [["benchmarks/distributed.py", "--sections", "ddp,fsdp", "--steps", "5", "--rounds",
             "12", "--warmup", "3", "--layers", "4", "--bucket-cap-mb", "1"]]),
    Family("zoo", "The model zoo and torchvision", """\
`benchmarks/models.py`: the 21 tiny transformers (and one resnet) configs of
`tests/test_model_zoo.py`, random weights, inference (`no_grad`) and a training step; systems in
turns, 5 calls a turn. Each cell the median per call and its ratio to `torch.compile` (Inductor),
paired round by round; the stored run times `torch.compile(backend="keraunos")` with fusion.
`benchmarks/vision.py`: torchvision's convnets per call, keraunos's fused program
(`fuse="wait"`) and `torch.compile`, one call of each per round.""",
           [["benchmarks/models.py", "--iters", "30"],
            ["benchmarks/vision.py", "--models", "resnet18,mobilenet_v3_small,efficientnet_b0",
             "--modes", "eval,train", "--rounds", "30"]]),
    Family("reliability", "Reliability: memory and threads", """\
`benchmarks/reliability.py`, not a timing: one jitted module called many times over 40 input
shapes with the default 8-entry cache, with every size compiled in (`dynamic=False`: nearly
every call compiles and evicts) and with automatic symbolic sizes; then 8 threads calling one
jitted function with mixed shapes and grad on and off, every result compared with eager's. The
differential fuzzer's campaigns are in docs/reliability.md.""",
           [["benchmarks/reliability.py"]]),
    Family("coverage", "Op coverage", """\
`benchmarks/coverage.py`: every OpInfo of PyTorch's database, forward, backward and in-place,
compared with eager (the failing ops, with reasons: docs/coverage.md, docs/coverage_fusion.md).""",
           [["benchmarks/coverage.py"],
            ["benchmarks/coverage.py", "--max-samples", "1", "--jobs", "2", "--executors",
             "inductor,torch"]]),
]

HEADLINES = [
    Headline("tiers", "", "keraunos", "first result", "32-layer litgpt, first result",
             "regional torch.compile"),
    Headline("tiers", "", "keraunos", "all fused", "32-layer litgpt, time until fused",
             "regional torch.compile"),
    Headline("tiers", "", "keraunos", "restart fused", "32-layer litgpt, restart until fused",
             "regional torch.compile"),
    Headline("tiers", "", "keraunos", "per call", "32-layer litgpt, per call",
             "regional torch.compile"),
    Headline("overhead", "", "tiny", "keraunos.jit", "`(x*2+1).relu()`, per call", "eager"),
    Headline("overhead", "", "decode", "keraunos.jit", "litgpt decode step, per call", "eager"),
    Headline("fusion", "(a)", "keraunos+inductor", "vs torch.compile",
             "(a) 32-layer litgpt, fused, per call", "torch.compile"),
    Headline("fusion", "(b)", "keraunos+inductor", "vs torch.compile",
             "(b) compute-bound litgpt, fused, per call", "torch.compile"),
    Headline("fusion", "(c)", "keraunos+inductor", "vs torch.compile",
             "(c) training step, fused", "torch.compile"),
    Headline("train", "", "keraunos fused", "vs torch.compile",
             "training step, eager AdamW", "torch.compile"),
    Headline("train", "", "keraunos step fused", "vs torch.compile",
             "whole training step, one program", "torch.compile"),
    Headline("generate", "", "llama: keraunos+inductor", "vs torch.compile",
             "HF Llama decode step, fused", "torch.compile"),
    Headline("zoo", "torchvision", "resnet18 eval", "keraunos", "resnet18 eval, per call",
             "torch.compile"),
    Headline("zoo", "torchvision", "efficientnet_b0 train", "keraunos",
             "efficientnet_b0 training step", "torch.compile"),
    Headline("distributed", "DDP", "keraunos DDP(jit(m))", "vs eager",
             "DDP training step, 2 ranks", "eager DDP"),
]

METHOD = """\
- **One intra-op thread** (`torch.set_num_threads(1)`) in every process: the two cores do not
  make the figures depend on what else runs.
- **Ratios within one run.** Every script measures eager, keraunos and `torch.compile` in the
  same run, where they share a process **in turns** (a block of calls of each system per round,
  the order rotating, medians over the rounds): a change of load falls on all alike. Read the
  ratios; absolute times vary with the machine and the load, ratios much less.
- **Cold**: a fresh process, empty Inductor cache and keraunos store (`TORCHINDUCTOR_CACHE_DIR`,
  `KERAUNOS_CACHE_DIR`); a **warm restart**: a second process on the caches the cold one left.
- **First result**: wall time from the `keraunos.jit` (or `torch.compile`) call to the first
  output; **time until fused**: until every call runs the fused program; **per call**: the
  median of warm calls once fused. Every system's output is compared with eager's before it is
  timed; a system that differs or fails is shown as such, never timed silently."""

TRIED = """\
- Inductor's `cpp_wrapper` (one translation unit per region): 4 g++ builds instead of 12 on the training step, but 52.8 s of CPU instead of 40.4 s.
- The backend route's 2-layer decode step cut at its layers (4 regions): 1.12-1.14x Inductor's step, against 1.00-1.05x as one region.
- Channels-last layouts propagated from efficientnet_b0's forward regions into its backward: 1.06x `torch.compile`'s step, as before.
- A `convolution_backward` layout per convolution kind (dense 1x1 channels-last, depthwise NCHW): 1.009x on efficientnet_b0's step, against 0.99x kept.
- Regions cut at every layer rather than only at alike layers, efficientnet_b0's step: 1.046x against 1.055x, within the noise."""


# ------------------------------------------------------------------------------- rendering
def load(results: pathlib.Path) -> dict[str, dict]:
    """family name -> its results file, for the families that have one."""
    out = {}
    for family in FAMILIES:
        path = results / f"{family.name}.json"
        if path.exists():
            out[family.name] = json.loads(path.read_text())
    return out


def _markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    escape = (lambda cell: str(cell).replace("|", "\\|"))
    return (["| " + " | ".join(map(escape, columns)) + " |",
             "|" + "---|" * len(columns)]
            + ["| " + " | ".join(map(escape, row)) + " |" for row in rows])


def _provenance(run: dict) -> str:
    return (f"`{run['command']}` at {run['commit']}, {run['date']}"
            + (f", {run['load']}" if run.get("load") else ""))


def _render_family(family: Family, stored: dict) -> list[str]:
    lines = [f"## {family.title}", "", family.about, ""]
    runs = stored["runs"]
    if family.merge:
        columns = [runs[0]["tables"][0]["columns"][0]] + runs[0]["tables"][0]["columns"][1:]
        rows = [[f"{run['label']}: {row[0]}"] + row[1:]
                for run in runs for table in run["tables"] for row in table["rows"]]
        ratios = runs[0]["tables"][0].get("ratios_to")
        if ratios:
            lines += [f"Ratios to {ratios}.", ""]
        lines += _markdown_table(columns, rows) + [""]
        shared = {(run["commit"], run["date"], run.get("load", "")) for run in runs}
        if len(shared) == 1:  # one provenance line, the commands one per row label
            commit, date, load = shared.pop()
            lines += [f"Measured at {commit}, {date}" + (f", {load}" if load else "") + ", by "
                      + "; ".join(f"`{run['command']}` ({run['label']})" for run in runs) + "."]
        else:
            lines += [f"- {run['label']}: {_provenance(run)}" for run in runs] + [""]
        notes = [run["notes"] for run in runs if run.get("notes")]
        return lines + ([" ".join(notes)] if notes else []) + [""]
    for run in runs:
        for table in run["tables"]:
            caption = table.get("caption", "")
            ratios = table.get("ratios_to")
            if caption:
                head = caption + (f" (ratios to {ratios})" if ratios else "")
                lines += [f"**{head[0].upper() + head[1:]}**", ""]
            elif ratios:
                lines += [f"Ratios to {ratios}.", ""]
            lines += _markdown_table(table["columns"], table["rows"]) + [""]
        lines += [f"Measured by {_provenance(run)}."]
        if run.get("notes"):
            lines += [run["notes"]]
        lines += [""]
    return lines


def ratio_of(cell: str) -> float | None:
    """The ratio a cell shows: ``0.70x`` alone or ``7.5 ms (0.70x)``."""
    found = re.findall(r"([0-9]+(?:\.[0-9]+)?)x", cell)
    return float(found[-1]) if found else None


def headline(stored: dict[str, dict]) -> list[tuple[Headline, float, dict]]:
    """(the headline, its ratio, the run it comes from) for every headline found in the results."""
    out = []
    for h in HEADLINES:
        for run in stored.get(h.family, {}).get("runs", []):
            found = None
            for table in run["tables"]:
                if not table.get("caption", "").startswith(h.caption) or \
                        h.column not in table["columns"]:
                    continue
                column = table["columns"].index(h.column)
                for row in table["rows"]:
                    if row[0].startswith(h.row) and ratio_of(row[column]) is not None:
                        found = ratio_of(row[column])
                        break
                if found is not None:
                    break
            if found is not None:
                out.append((h, found, run))
                break
    return out


def headline_table(stored: dict[str, dict], link: str) -> list[str]:
    rows = [[h.label, f"{value:.2f}x", h.against, f"[{h.family}]({link}#{_anchor(h.family)})"]
            for h, value, run in headline(stored)]
    return _markdown_table(["workload", "keraunos", "against", "details"], rows)


def _anchor(name: str) -> str:
    title = next(f.title for f in FAMILIES if f.name == name)
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def machines(stored: dict[str, dict]) -> list[str]:
    seen = {}
    for data in stored.values():
        for run in data["runs"]:
            seen.setdefault(run["machine"], []).append(run["date"])
    return [f"- {machine} ({min(dates)} to {max(dates)})" if min(dates) != max(dates)
            else f"- {machine} ({dates[0]})" for machine, dates in seen.items()]


def render(stored: dict[str, dict]) -> str:
    lines = ["# Benchmarks", "",
             "<!-- Rendered by benchmarks/report.py from benchmarks/results/*.json: "
             "edit those or the script, not this page. -->", "",
             "How fast keraunos is against eager PyTorch and `torch.compile`, per kind of "
             "workload. `python benchmarks/report.py --run` measures every table again and "
             "rewrites this page (an hour or more on 2 cores); `python benchmarks/report.py` "
             "renders it from the stored results. Each table names the command that printed "
             "it and the commit it was measured on.", "",
             "## The machine", "", *machines(stored), "",
             "Load: \"quiet\" means nothing else ran; \"loaded\" runs shared the cores with "
             "other work, so only their ratios (measured in turns) mean anything.", "",
             "## Method", "", METHOD, "",
             "## Headline figures", "",
             "Each keraunos figure as a ratio to the system named (lower is better).", "",
             *headline_table(stored, ""), "",
             f"![headline ratios]({CHART.name})", ""]
    for family in FAMILIES:
        if family.name in stored:
            lines += _render_family(family, stored[family.name])
    lines += ["## Tried and not kept", "", TRIED, ""]
    return "\n".join(lines)


def chart(stored: dict[str, dict], path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: it needs matplotlib (pip install 'keraunos[bench]')", file=sys.stderr)
        return False
    found = headline(stored)
    labels = [f"{h.label.replace('`', '')} (vs {h.against})" for h, _, _ in found]
    values = [value for _, value, _ in found]
    figure, axes = plt.subplots(figsize=(9, 0.42 * len(found) + 1.2))
    bars = axes.barh(range(len(found)), values,
                     color=["tab:green" if v < 1 else "tab:orange" for v in values])
    axes.bar_label(bars, [f"{v:.2f}x" for v in values], padding=3, fontsize=8)
    axes.set_yticks(range(len(found)), labels, fontsize=8)
    axes.invert_yaxis()
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_xlabel("keraunos time / the other system's (lower is better)")
    axes.set_xlim(0, max(values + [1.0]) * 1.15)
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)
    return True


def update_readme(stored: dict[str, dict], path: pathlib.Path) -> None:
    text = path.read_text()
    if HEADLINE_START not in text or HEADLINE_END not in text:
        print(f"{path}: no headline markers, left as it is", file=sys.stderr)
        return
    head, rest = text.split(HEADLINE_START, 1)
    _, tail = rest.split(HEADLINE_END, 1)
    table = "\n".join(headline_table(stored, "docs/benchmarks.md"))
    path.write_text(f"{head}{HEADLINE_START}\n{table}\n{HEADLINE_END}{tail}")


# ------------------------------------------------------------------------------- measuring
def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    # (what a --run writes itself, the results and the page, does not count as a change)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!benchmarks/results", ":!docs"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + (" with uncommitted changes" if dirty else "")


def _machine() -> str:
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__); "
                            "print(torch.cuda.get_device_name() if torch.cuda.is_available() "
                            "else 'no GPU')"], capture_output=True, text=True)
    version, gpu = (probe.stdout.split("\n") + ["?", "?"])[:2]
    return f"{os.cpu_count()} cores, {gpu}, torch {version}"


def _label(argv: list[str]) -> str:
    model = argv[argv.index("--model") + 1] if "--model" in argv else ""
    return f"{model} {'train' if '--train' in argv else 'eval'}"


def measure(family: Family, quick: bool) -> dict | None:
    """Runs every command of the family; its results, or None if one failed."""
    runs = []
    for argv in family.runs:
        argv = argv + (["--quick"] if quick else [])
        command = "python " + shlex.join(argv)
        with tempfile.TemporaryDirectory() as folder:
            out = pathlib.Path(folder) / "figures.json"
            load = os.getloadavg()[0]
            print(f"{family.name}: {command}", flush=True)
            done = subprocess.run([sys.executable, *argv, "--json", str(out)], cwd=ROOT)
            if not out.exists():
                print(f"{family.name}: {command} wrote no figures (exit status "
                      f"{done.returncode})", file=sys.stderr)
                return None
            figures = json.loads(out.read_text())
        if isinstance(figures, list):  # benchmarks/fusion.py's rows
            figures = _script("fusion").report_tables(figures)
        runs.append(dict(command=command, commit=_commit(), commit_source="git rev-parse HEAD",
                         date=datetime.date.today().isoformat(), machine=_machine(),
                         load=f"load average {load:.1f} at the start",
                         label=_label(argv) if family.merge else "", tables=figures["tables"]))
    return {"family": family.name, "runs": runs}


def _script(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}",
                                                  ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="measure again before rendering")
    parser.add_argument("--quick", action="store_true",
                        help="with --run: every script's --quick (proves every path runs)")
    parser.add_argument("--families", default="",
                        help=f"with --run, comma-separated, of {', '.join(f.name for f in FAMILIES)}"
                        " (default all)")
    parser.add_argument("--results", default="", help=f"default {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--output", default="", help=f"default {OUTPUT.relative_to(ROOT)}")
    parser.add_argument("--chart", default=None,
                        help=f"PNG to draw ('' for none; default {CHART.relative_to(ROOT)})")
    parser.add_argument("--readme", default=None,
                        help="README whose headline table to rewrite ('' for none; default "
                        "README.md)")
    args = parser.parse_args(argv)
    scratch = args.quick and not (args.results or args.output)
    if scratch:  # quick figures must never replace the stored ones
        folder = pathlib.Path(tempfile.mkdtemp(prefix="keraunos-report-"))
        print(f"--quick: results and page go to {folder}")
        results, output = folder / "results", folder / "benchmarks.md"
        chart_path, readme = folder / CHART.name, None
    else:
        results = pathlib.Path(args.results) if args.results else RESULTS
        output = pathlib.Path(args.output) if args.output else OUTPUT
        chart_path = CHART if args.chart is None else (pathlib.Path(args.chart)
                                                       if args.chart else None)
        readme = README if args.readme is None else (pathlib.Path(args.readme)
                                                     if args.readme else None)
    failed = False
    if args.run:
        wanted = [f for f in args.families.split(",") if f]
        unknown = set(wanted) - {f.name for f in FAMILIES}
        if unknown:
            parser.error(f"unknown families {sorted(unknown)}")
        results.mkdir(parents=True, exist_ok=True)
        for family in FAMILIES:
            if wanted and family.name not in wanted:
                continue
            measured = measure(family, args.quick)
            if measured is None:
                failed = True
                continue
            (results / f"{family.name}.json").write_text(json.dumps(measured, indent=1) + "\n")
    stored = load(results)
    output.write_text(render(stored))
    print(f"wrote {output}")
    if chart_path is not None and chart(stored, chart_path):
        print(f"wrote {chart_path}")
    if readme is not None:
        update_readme(stored, readme)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
