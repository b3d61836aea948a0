"""``python -m keraunos.testing.fuzz --programs 10000 --seed 0 [--jobs N]``: run, summarize, shrink.

Prints passes, mismatches, rounding (float mismatches classified as float32 rounding against
float64 eager, with the evidence), internal errors and refusals (by cause), then one shrunk
reproducer per distinct failure (unshrunk for rounding); exits 1 on any mismatch or internal
error, not on rounding.

``--back-to-back``: every program in this one process, in order, jitted with the defaults
(fused in the background, never waited for), the eager side's steps under
``warnings.simplefilter("error")``; a program also fails when the process state its thread sees
changes or when its fused tier fails to compile (campaign.BackToBack). Reproducers are printed
as generated, with the programs to run before each.

``--autocast bfloat16`` (or ``float16``): both sides run every step under
``torch.autocast("cpu", dtype)``; floats are compared at that dtype's tolerance and a mismatch is
classified against float64 without autocast (rounding: the jitted value is as close to it as
eager autocast's own).
"""
from __future__ import annotations

import argparse
import sys

from .campaign import run_back_to_back, run_campaign


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
    parser.add_argument("--fuse", default=None, choices=("wait", "background"),
                        help="with fusion: the fused program from the first call (wait, the "
                             "default), or the torch tier first and the switch after the first "
                             "call (background)")
    parser.add_argument("--min-fused-ops", type=int, default=None,
                        help="fuse programs with fewer ops than tiers.MIN_FUSED_OPS too")
    parser.add_argument("--back-to-back", action="store_true",
                        help="all programs in this process, one after another, on the default "
                             "tier (fused in the background, never waited for); eager steps "
                             "under warnings.simplefilter('error')")
    parser.add_argument("--drain", type=float, default=0.0,
                        help="--back-to-back: seconds to wait at the end for the fused compiles "
                             "still under way, to check them too")
    parser.add_argument("--autocast", default=None, choices=("bfloat16", "float16"),
                        help="every step of both sides under torch.autocast('cpu', dtype): "
                             "compared at that dtype's tolerance, classified against float64")
    args = parser.parse_args(argv)
    if args.back_to_back and (args.jobs != 1 or args.fuse is not None):
        parser.error("--back-to-back runs in one process on the default tier: "
                     "no --jobs, no --fuse")
    if args.min_fused_ops is not None:
        from ...runtime import tiers
        tiers.MIN_FUSED_OPS = args.min_fused_ops
    names = args.only or [f"{args.seed}:{i}" for i in range(args.programs)]
    if args.back_to_back:
        report = run_back_to_back(names, per_kind=args.per_kind, progress=sys.stderr,
                                  executors=args.executors.split(",") if args.executors else None,
                                  drain_s=args.drain, autocast=args.autocast)
        print(report.summary())
        print(report.reproducers_text())
        return 1 if report.failures else 0
    report = run_campaign(names, jobs=args.jobs, shrink_budget=0 if args.no_shrink else args.shrink_budget,
                          per_kind=args.per_kind, progress=sys.stderr,
                          executors=args.executors.split(",") if args.executors else None,
                          fuse=args.fuse or "wait", autocast=args.autocast)
    print(report.summary())
    print(report.reproducers_text())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
