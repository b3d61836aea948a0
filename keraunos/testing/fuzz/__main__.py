"""``python -m keraunos.testing.fuzz --programs 10000 --seed 0 [--jobs N]``: run, summarize, shrink.

Prints passes, mismatches, rounding (float mismatches classified as float32 rounding against
float64 eager, with the evidence), internal errors and refusals (by cause), then one shrunk
reproducer per distinct failure (unshrunk for rounding); exits 1 on any mismatch or internal
error, not on rounding.
"""
from __future__ import annotations

import argparse
import sys

from .campaign import run_campaign


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keraunos.testing.fuzz", description=__doc__)
    parser.add_argument("--programs", type=int, default=1000, help="how many programs")
    parser.add_argument("--seed", type=int, default=0, help="programs are named <seed>:<index>")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--only", action="append", default=[],
                        help="run just these programs (a name printed by an earlier run)")
    parser.add_argument("--shrink-budget", type=float, default=60.0,
                        help="seconds spent shrinking each distinct failure")
    parser.add_argument("--per-kind", type=int, default=2,
                        help="programs shrunk per distinct failure (one check can hide several causes)")
    parser.add_argument("--no-shrink", action="store_true", help="print failures as generated")
    parser.add_argument("--executors", default=None,
                        help="jit with these, comma-separated (inductor,torch: with fusion)")
    parser.add_argument("--fuse", default="wait", choices=("wait", "background"),
                        help="with fusion: the fused program from the first call (wait), or the "
                             "torch tier first and the switch after the first call (background)")
    parser.add_argument("--min-fused-ops", type=int, default=None,
                        help="fuse programs with fewer ops than tiers.MIN_FUSED_OPS too")
    args = parser.parse_args(argv)
    if args.min_fused_ops is not None:
        from ... import tiers
        tiers.MIN_FUSED_OPS = args.min_fused_ops
    names = args.only or [f"{args.seed}:{i}" for i in range(args.programs)]
    report = run_campaign(names, jobs=args.jobs, shrink_budget=0 if args.no_shrink else args.shrink_budget,
                          per_kind=args.per_kind, progress=sys.stderr,
                          executors=args.executors.split(",") if args.executors else None,
                          fuse=args.fuse)
    print(report.summary())
    print(report.reproducers_text())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
