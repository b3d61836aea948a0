"""Many programs: run them (in worker processes if asked), count outcomes, shrink each distinct
failure once."""
from __future__ import annotations

import multiprocessing
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

import keraunos

from ..opinfo import FUSED
from . import compare
from .drive import run_program
from .side import Outcome
from .generate import generate
from .shrink import shrink


@dataclass
class Report:
    outcomes: dict[str, Outcome] = field(default_factory=dict)      # program name -> outcome
    reproducers: dict[tuple, list[str]] = field(default_factory=dict)  # signature -> shrunk scripts
    seconds: float = 0.0

    @property
    def failures(self) -> dict[tuple, list[str]]:
        """Distinct failures (status, check) -> the programs that fail so."""
        groups = defaultdict(list)
        for name, o in self.outcomes.items():
            if o.status in ("mismatch", "internal error"):
                groups[o.signature].append(name)
        return dict(groups)

    def summary(self) -> str:
        counts = Counter(o.status for o in self.outcomes.values())
        calls = sum(o.calls for o in self.outcomes.values())
        ended = sum(1 for o in self.outcomes.values() if o.ended_by_error)
        lines = [f"{len(self.outcomes)} programs, {calls} calls compared, {self.seconds:.0f} s",
                 *(f"  {status:>15}: {counts.get(status, 0)}"
                   for status in ("pass", "mismatch", "rounding", "internal error", "refusal")),
                 f"  ({ended} passing programs ended early because eager raised as well)"]
        refusals = Counter(o.check for o in self.outcomes.values() if o.status == "refusal")
        if refusals:
            lines.append("refusals by cause:")
            lines += [f"  {n:5d}  {cause}" for cause, n in refusals.most_common()]
        rounding = [(name, o) for name, o in self.outcomes.items() if o.status == "rounding"]
        if rounding:  # not failures, but the evidence is shown so that anyone can check it
            lines.append("rounding (float32 rounding of an ill-conditioned program, not counted "
                         "as failures):")
            lines += [f"  {name}: {o.check}: {o.detail.splitlines()[-1]}" for name, o in rounding]
        if self.failures:
            lines.append("failures by kind:")
            for (status, check), names in sorted(self.failures.items(), key=lambda kv: -len(kv[1])):
                lines.append(f"  {len(names):5d}  {status}: {check}   (e.g. {', '.join(names[:3])})")
        return "\n".join(lines)

    @property
    def rounding(self) -> dict[tuple, list[str]]:
        """Mismatches classified as rounding, (status, check) -> programs."""
        groups = defaultdict(list)
        for name, o in self.outcomes.items():
            if o.status == "rounding":
                groups[o.signature].append(name)
        return dict(groups)

    def reproducers_text(self) -> str:
        """One shrunk, runnable reproducer per distinct failure (and unshrunk ones for rounding)."""
        return "\n\n".join(f"# ===== {status}: {check}\n{script}"
                             for (status, check), scripts in self.reproducers.items()
                             for script in dict.fromkeys(scripts))


# ``--executors``: what the programs are jitted with (the worker processes are forked after
# ``run_campaign`` sets it, so they see it too).
_executors: list[str] | None = None
# ``--fuse``: "wait" (the fused program from the first call) or "background" (the first calls
# on the torch tier, then the switch: each call is followed by a wait for the fused tier, so
# that every program's later calls run it and the switch falls between two compared calls).
_fuse: str = "wait"


def _jit(fn):
    if _executors is None:
        return keraunos.jit(fn, fuse="off")
    return keraunos.jit(fn, executors=_executors, fuse=_fuse)


def _after_call(jitted) -> None:
    if _fuse == "background":
        keraunos.wait_for_fusion(jitted, 600)


def _fused() -> bool:
    """With fusion, a float mismatch is also compared with ``torch.compile``'s value."""
    return bool(_executors) and "inductor" in _executors


def _run_one(name: str) -> tuple[str, Outcome]:
    return name, run_program(generate(name), _jit, compile_reference=_fused(),
                             after_call=_after_call)


def _shrink_one(job) -> tuple[tuple, str]:
    name, outcome, budget = job
    program, result = shrink(generate(name), outcome, budget_s=budget,
                             run=lambda p: run_program(p, _jit, compile_reference=_fused(),
                                                       after_call=_after_call))
    return outcome.signature, program.reproducer(str(result))


def _init_worker() -> None:
    torch.set_num_threads(1)


def run_campaign(names: list[str], jobs: int = 1, shrink_budget: float = 60.0,
                 per_kind: int = 2, progress=None, executors: list[str] | None = None,
                 fuse: str = "wait") -> Report:
    """Run the programs ``names``; shrink up to ``per_kind`` programs of each distinct failure
    (one kind of check can hide several causes). ``executors``: jit them with these (with
    ``inductor``, floats are compared at ``opinfo.FUSED``'s tolerance, as the OpInfo sweep with
    fusion is: Inductor's kernels round differently from eager's)."""
    global _executors, _fuse
    _executors = list(executors) if executors else None
    _fuse = fuse
    if _executors and "inductor" in _executors:
        compare.RTOL, compare.ATOL = FUSED["rtol"], FUSED["atol"]
    start = time.monotonic()
    report = Report()
    pool = multiprocessing.get_context("fork").Pool(jobs, _init_worker) if jobs > 1 else None
    mapper = pool.imap_unordered if pool else map
    try:
        for done, (name, outcome) in enumerate(mapper(_run_one, names), 1):
            report.outcomes[name] = outcome
            if progress and done % 100 == 0:
                progress.write(f"{done}/{len(names)} programs\n")
        if shrink_budget > 0:
            jobs_ = [(name, report.outcomes[name], shrink_budget)
                     for names_ in report.failures.values() for name in names_[:per_kind]]
            for signature, script in mapper(_shrink_one, jobs_):
                report.reproducers.setdefault(signature, []).append(script)
        else:
            for signature, names_ in report.failures.items():
                report.reproducers[signature] = [generate(name).reproducer(str(report.outcomes[name]))
                                                 for name in names_[:per_kind]]
        # Rounding is kept as generated (shrinking would classify every candidate again, with
        # torch.compile under fusion): the evidence is in the reproducer's comment.
        for signature, names_ in report.rounding.items():
            report.reproducers[signature] = [generate(name).reproducer(str(report.outcomes[name]))
                                             for name in names_[:per_kind]]
    finally:
        if pool:
            pool.close()
            pool.join()
    report.seconds = time.monotonic() - start
    return report
