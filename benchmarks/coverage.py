"""Op coverage on PyTorch's OpInfo database: the whole sweep, with counts and docs/coverage.md.

Run: python benchmarks/coverage.py [--max-samples N] [--output docs/coverage.md]
         [--executors inductor,torch] [--ops NAME,...] [--jobs N]

For every OpInfo with float32 CPU samples, forward, backward (ops that support autograd) and
in-place (ops with an inplace variant) are compared with eager (keraunos/testing/opinfo.py).
Prints pass / fail / not-applicable counts per category and writes the list of failing ops with
the first line of their error.

``--executors inductor,torch`` runs the sweep with fusion: every op, even alone in its program,
is a region compiled by Inductor, and values are compared at PyTorch's own tolerance for compiled
models (``opinfo.FUSED``; docs/coverage.md says why). It writes docs/coverage_fusion.md unless
``--output`` says otherwise. Each sample is an Inductor compile (about a second of C++ each here),
so the whole sweep with fusion takes hours; ``--ops`` and ``--max-samples`` make it shorter, and
``--jobs N`` splits the ops over N processes (op i goes to process i mod N).
"""
from __future__ import annotations

import argparse
import json
import collections
import concurrent.futures
import contextlib
import datetime
import multiprocessing
import pathlib
import time
import warnings

import torch

from keraunos.executors.fusion.regions import fusing_single_ops
from keraunos.testing.opinfo import FUSED, KINDS, check_op, op_database, op_name

DOCS = pathlib.Path(__file__).parent.parent / "docs"


FUSION_SECTION = """## With fusion

`python benchmarks/coverage.py --executors inductor,torch` runs the same sweep with the inductor
executor (writing docs/coverage_fusion.md): each op, even alone in its program, becomes a region
compiled by Inductor. Inductor is not bitwise equal to eager (PyTorch does not promise it): it
lowers ops through its own decompositions (softmax as `exp(x - max) / sum`, variance and layer norm
by Welford's method, `addmm` as a matmul plus an add), reduces in its own order (vector lanes
summed last, reductions split across threads), and vectorizes where eager's kernel runs scalar code
(or the reverse), so transcendental functions differ by about an ulp; on GPU, Triton also contracts
`a * b + c` into fused multiply-adds. PyTorch's own accuracy check of compiled models,
`torch._dynamo.utils.same` (used by its benchmark suites and the accuracy minifier), compares
float32 at `rtol = atol = 1e-4`; the sweep with fusion uses the same (`opinfo.FUSED`), where the
torch executor's sweep uses `torch.testing`'s float32 defaults (`rtol = 1.3e-6`, `atol = 1e-5`).
Everything else is compared as strictly as without fusion: shapes, dtypes, in-place effects on
inputs, random values under one seed (random ops stay out of regions). CI runs 30 ops of it, the
first sample of each, forward (and 4 of them backward too):
`tests/test_fusion.py::test_opinfo_subset_with_fusion_matches_eager`."""


def _sweep(shard: int, shards: int, wanted, max_samples: int, executors):
    """Checks every op whose index in the database is ``shard`` mod ``shards``: a list of
    (index, kind, result)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    fusing = executors is not None and "inductor" in executors
    checked = []
    with fusing_single_ops() if fusing else contextlib.nullcontext():
        for index, op in enumerate(op_database()):
            if index % shards != shard or (wanted and op_name(op) not in wanted):
                continue
            for kind in KINDS:
                checked.append((index, kind, check_op(op, kind, max_samples or None, executors)))
    return checked


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-samples", type=int, default=0, help="0: every sample")
    parser.add_argument("--output", default="", help="default: docs/coverage.md, or "
                        "docs/coverage_fusion.md with a fusion executor")
    parser.add_argument("--executors", default="", help="comma-separated, for keraunos.jit "
                        "(default: keraunos's default list)")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="processes to split the ops over")
    parser.add_argument("--json", default="", help="also write the pass rates to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="four ops, one sample each, and no markdown written unless "
                        "--output names it: proves every path runs")
    args = parser.parse_args()
    if args.quick:
        args.ops, args.max_samples = args.ops or "add,mul,sum,exp", 1
    executors = [e for e in args.executors.split(",") if e] or None
    fusing = executors is not None and "inductor" in executors
    output = args.output or str(DOCS / ("coverage_fusion.md" if fusing else "coverage.md"))
    wanted = frozenset(n for n in args.ops.split(",") if n)
    start = time.time()
    results = collections.defaultdict(list)
    if args.jobs <= 1:
        shards = [_sweep(0, 1, wanted, args.max_samples, executors)]
    else:
        spawn = multiprocessing.get_context("spawn")  # a fresh torch in each, no forked threads
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
            shards = list(pool.map(_sweep, range(args.jobs), [args.jobs] * args.jobs,
                                   [wanted] * args.jobs, [args.max_samples] * args.jobs,
                                   [executors] * args.jobs))
    for shard in shards:  # back in the database's order
        for index, kind, result in shard:
            results[kind].append((index, result))
    results = collections.defaultdict(list, {
        kind: [r for _, r in sorted(rs, key=lambda ir: ir[0])] for kind, rs in results.items()})
    elapsed = time.time() - start
    command = "python benchmarks/coverage.py" + "".join(
        f" --{flag} {value}" for flag, value in (("max-samples", args.max_samples),
                                                 ("executors", args.executors),
                                                 ("ops", args.ops)) if value)
    what = "every sample" if not args.max_samples else f"the first {args.max_samples} samples"
    title = "Op coverage on PyTorch's OpInfo database" + (
        f", with executors={executors}" if executors else "")
    lines = [f"# {title}", "",
             f"Measured {datetime.date.today()} with torch {torch.__version__}, {what} of each "
             f"OpInfo, in {elapsed:.0f} s, by:", "", "```", command, "```", ""]
    if fusing:
        lines += [f"Values compared at rtol = {FUSED['rtol']}, atol = {FUSED['atol']} "
                  f"(docs/coverage.md, 'With fusion', says why).", ""]
    lines += ["| category | passed | failed | not applicable | pass rate |",
              "|---|---|---|---|---|"]
    json_rows = []
    for kind in KINDS:
        counts = collections.Counter(r.status for r in results[kind])
        applicable = counts["passed"] + counts["failed"]
        rate = counts["passed"] / applicable if applicable else 0.0
        lines.append(f"| {kind} | {counts['passed']} | {counts['failed']} | "
                     f"{counts['not applicable']} | {rate:.1%} |")
        json_rows.append([kind, str(counts["passed"]), str(counts["failed"]),
                          str(counts["not applicable"]), f"{rate:.1%}"])
        print(f"{kind:>9}: {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['not applicable']} not applicable ({rate:.1%} of applicable)")
    for kind in KINDS:
        failed = [r for r in results[kind] if r.status == "failed"]
        lines += ["", f"## {kind}: failing ops ({len(failed)})", ""]
        lines += [f"- `{r.op}`: {r.message}" for r in failed] or ["(none)"]
    if not fusing:
        lines += ["", FUSION_SECTION]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tables": [{"columns": ["category", "passed", "failed", "not applicable",
                                               "pass rate"], "rows": json_rows}]}, f, indent=1)
    if args.quick and not args.output:
        return
    pathlib.Path(output).write_text("\n".join(lines) + "\n")
    print(f"wrote {output} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
