"""Op coverage on PyTorch's OpInfo database: the whole sweep, with counts and docs/coverage.md.

Run: python benchmarks/coverage.py [--max-samples N] [--output docs/coverage.md]

For every OpInfo with float32 CPU samples, forward, backward (ops that support autograd) and
in-place (ops with an inplace variant) are compared with eager (keraunos/testing/opinfo.py).
Prints pass / fail / not-applicable counts per category and writes the list of failing ops with
the first line of their error.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import pathlib
import time
import warnings

import torch

from keraunos.testing.opinfo import KINDS, check_op, op_database


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-samples", type=int, default=0, help="0: every sample")
    parser.add_argument("--output", default=str(pathlib.Path(__file__).parent.parent / "docs" /
                                                "coverage.md"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    start = time.time()
    results = collections.defaultdict(list)
    for op in op_database():
        for kind in KINDS:
            results[kind].append(check_op(op, kind, args.max_samples or None))
    elapsed = time.time() - start
    lines = ["# Op coverage on PyTorch's OpInfo database", "",
             f"Measured {datetime.date.today()} with torch {torch.__version__}, "
             f"{'every sample' if not args.max_samples else f'the first {args.max_samples} samples'}"
             f" of each OpInfo, in {elapsed:.0f} s, by:", "",
             "```", f"python benchmarks/coverage.py"
             f"{'' if not args.max_samples else f' --max-samples {args.max_samples}'}", "```", "",
             "| category | passed | failed | not applicable | pass rate |", "|---|---|---|---|---|"]
    for kind in KINDS:
        counts = collections.Counter(r.status for r in results[kind])
        applicable = counts["passed"] + counts["failed"]
        rate = counts["passed"] / applicable if applicable else 0.0
        lines.append(f"| {kind} | {counts['passed']} | {counts['failed']} | "
                     f"{counts['not applicable']} | {rate:.1%} |")
        print(f"{kind:>9}: {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['not applicable']} not applicable ({rate:.1%} of applicable)")
    for kind in KINDS:
        failed = [r for r in results[kind] if r.status == "failed"]
        lines += ["", f"## {kind}: failing ops ({len(failed)})", ""]
        lines += [f"- `{r.op}`: {r.message}" for r in failed] or ["(none)"]
    pathlib.Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
