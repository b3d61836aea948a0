"""Many programs: run them (in worker processes if asked, or back to back in this process),
count outcomes, shrink each distinct failure once."""
from __future__ import annotations

import contextlib
import multiprocessing
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

import keraunos

from ..opinfo import FUSED
from . import compare, process_state, side
from .drive import _cause, _first_line, run_program
from .side import Outcome
from .generate import generate
from .shrink import shrink


@dataclass
class Report:
    outcomes: dict[str, Outcome] = field(default_factory=dict)      # program name -> outcome
    reproducers: dict[tuple, list[str]] = field(default_factory=dict)  # signature -> shrunk scripts
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # printed after the counts (--back-to-back)

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
        lines += self.notes
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
# ``--back-to-back``: every program in this process, one after another, on the default tier
# (``fuse="background"``, the default executors unless ``--executors``), never waiting for a
# fused tier: one program's fused compile overlaps the next programs' captures and calls.
_back_to_back: bool = False


def use_autocast(dtype: str | None) -> None:
    """``--autocast``: both sides run every step under ``torch.autocast("cpu", dtype)``, and
    floats are compared at that dtype's tolerance (``torch.testing``'s); a mismatch is still
    classified against a float64 run without autocast, so "rounding" means the jitted value is
    as close to float64 as eager autocast's own."""
    if dtype is None:
        side.AMBIENT = None
        return
    cast = getattr(torch, dtype)
    side.AMBIENT = lambda: torch.autocast("cpu", dtype=cast)
    rtol = 1.6e-2 if cast is torch.bfloat16 else 1e-3
    compare.RTOL, compare.ATOL = max(compare.RTOL, rtol), max(compare.ATOL, 1e-5)


def _autocast_note() -> list[str]:
    if side.AMBIENT is None:
        return []
    with side.AMBIENT():
        dtype = torch.get_autocast_dtype("cpu")
    return [f"every step of both sides under torch.autocast('cpu', dtype={dtype}) "
            f"(replay with --autocast {str(dtype).split('.')[-1]})"]


def _jit(fn):
    if _back_to_back:
        if _executors is None:
            return keraunos.jit(fn, fuse="background")
        return keraunos.jit(fn, executors=_executors, fuse="background")
    if _executors is None:
        return keraunos.jit(fn, fuse="off")
    return keraunos.jit(fn, executors=_executors, fuse=_fuse)


def _after_call(jitted) -> None:
    if _fuse == "background" and not _back_to_back:
        keraunos.wait_for_fusion(jitted, 600)


def _fused() -> bool:
    """With fusion, a float mismatch is also compared with ``torch.compile``'s value."""
    if _executors is None:
        return _back_to_back  # the default executors fuse
    return "inductor" in _executors


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
                 fuse: str = "wait", back_to_back: bool = False,
                 autocast: str | None = None) -> Report:
    """Run the programs ``names``; shrink up to ``per_kind`` programs of each distinct failure
    (one kind of check can hide several causes). ``executors``: jit them with these (with
    ``inductor``, floats are compared at ``opinfo.FUSED``'s tolerance, as the OpInfo sweep with
    fusion is: Inductor's kernels round differently from eager's). ``back_to_back``: see
    ``run_back_to_back`` (``jobs`` and ``fuse`` do not apply)."""
    if back_to_back:
        return run_back_to_back(names, executors=executors, per_kind=per_kind, progress=progress,
                                autocast=autocast)
    start = time.monotonic()
    report = Report()
    with _campaign_settings(executors, fuse, False, autocast, report):
        pool = multiprocessing.get_context("fork").Pool(jobs, _init_worker) if jobs > 1 else None
        try:
            _run_in(pool, names, report, shrink_budget, per_kind, progress)
        finally:
            if pool:
                pool.close()
                pool.join()
    report.seconds = time.monotonic() - start
    return report


@contextlib.contextmanager
def _campaign_settings(executors, fuse: str, back_to_back: bool, autocast: str | None,
                       report: Report):
    """The settings the programs of a campaign read (this module's globals, the comparison's
    tolerances, autocast), set for the campaign and put back after it."""
    global _executors, _fuse, _back_to_back
    _executors = list(executors) if executors else None
    _fuse, _back_to_back = fuse, back_to_back
    saved = compare.RTOL, compare.ATOL, side.AMBIENT
    if _fused():
        compare.RTOL, compare.ATOL = FUSED["rtol"], FUSED["atol"]
    use_autocast(autocast)
    report.notes += _autocast_note()
    try:
        yield
    finally:
        _back_to_back = False
        compare.RTOL, compare.ATOL, side.AMBIENT = saved


def _run_in(pool, names: list[str], report: Report, shrink_budget: float, per_kind: int,
            progress) -> None:
    """Each program in ``names`` (on ``pool``'s workers, if any), then reproducers of up to
    ``per_kind`` programs of each failure: shrunk within ``shrink_budget`` seconds, or as
    generated."""
    mapper = pool.imap_unordered if pool else map
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
        _as_generated(report, report.failures, per_kind)
    # Rounding is kept as generated (shrinking would classify every candidate again, with
    # torch.compile under fusion): the evidence is in the reproducer's comment.
    _as_generated(report, report.rounding, per_kind)


# ----------------------------------------------------------------------- back to back


@contextlib.contextmanager
def warnings_as_errors():
    """What pytest's ``-W error`` and many harnesses wrap around code they run: a swap of the
    process's warnings filters for a copy whose first filter makes every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def fusion_failures(jitted) -> list[str]:
    """Why the fused tiers of ``jitted``'s cache entries (and of its subgraphs, when it fell back
    to ``torch.compile``) failed to compile, one line each; empty when none failed."""
    from ...runtime.call import state_of
    states = [state_of(jitted)]
    if getattr(states[0], "dynamo_compiled", None) is not None:
        from ...dynamo.backend import subgraphs_of
        states += [sub.jitted._keraunos for sub in subgraphs_of(jitted)]
    found = []
    for state in states:
        for entry in list(getattr(state, "entries", ())):
            error = getattr(getattr(entry, "tiering", None), "error", None)
            if error is not None:
                found.append(f"{type(error).__name__}: {_first_line(error)}")
    note = keraunos.compile_stats(jitted).fusion_note or ""
    if not found and "the fused compile failed" in note:
        found.append(note[:240])
    return found


def _tiered(jitted) -> bool:
    """A keraunos-jitted callable (its fused tiers can be waited for and checked)."""
    from ...runtime.call import state_of
    try:
        state_of(jitted)
    except Exception:  # noqa: BLE001 - a planted "compiler" of the tests
        return False
    return True


class BackToBack:
    """Programs run one after another in this process, each jitted with the defaults
    (``fuse="background"``): nothing waits for a fused tier, so the fused compiles of earlier
    programs run in the background while later programs capture, run and compare. The eager
    side's steps run inside ``warnings_as_errors()``; the jitted side's never do.

    Besides each program's own comparison, two things fail a program as an internal error:

    - the process state its thread sees (``process_state``: warnings filters, grad mode,
      autocast, configs of Dynamo and Inductor, ...) differs after a compared call from what it
      was after the previous one, or after the program from before it ("process state
      changed"); the state is then put back, so that one leak fails one program;
    - a fused tier of one of its entries failed to compile ("fused tier failed"), checked once
      the compile is done (a later program's turn; still pending at the end: counted apart).

    A failure names the programs it ran beside (those whose fused compiles were under way while
    it ran; for a fused tier, the program and those run while it compiled): running them again
    in that order is the replay (``--back-to-back --only A --only B ...``)."""

    def __init__(self, report: Report, compile_reference: bool, make_jitted=None):
        self.report = report
        self.compile_reference = compile_reference
        self.make_jitted = make_jitted or _jit  # what jits a program (tests plant others)
        self.pending: list[tuple[str, object]] = []  # (program, jitted) with fused tiers compiling
        self.overlapped: dict[str, list[str]] = {}   # program -> programs compiling meanwhile
        self.order: list[str] = []                   # the programs run, in order
        self.eager_warned = 0

    def run(self, name: str, program=None) -> Outcome:
        """Program ``name`` (``generate(name)``, or ``program``) after those run before."""
        self.collect()
        self.order.append(name)
        overlapping = [n for n, _ in self.pending]
        made: list = []
        changes: list[str] = []
        last: list[dict] = []

        def make(fn):
            jitted = self.make_jitted(fn)
            made.append(jitted)
            return jitted

        def after_call(jitted) -> None:
            now = process_state.snapshot()
            if last:
                changes.extend(f"between two calls: {d}"
                               for d in process_state.differences(last[0], now))
            last[:] = [now]

        before = process_state.snapshot()
        outcome = run_program(program or generate(name), make,
                              compile_reference=self.compile_reference,
                              after_call=after_call, eager_guard=warnings_as_errors)
        after = process_state.snapshot()
        changes += [f"over the program: {d}" for d in process_state.differences(before, after)]
        if changes:
            process_state.restore(before)
        overlapping = list(dict.fromkeys(overlapping + [n for n, _ in self.pending]))
        self.overlapped[name] = overlapping
        if "eager warned" in outcome.ended_by_error:
            self.eager_warned += 1
        if changes and outcome.status not in ("mismatch", "internal error"):
            settings = sorted({c.split(": ", 2)[1] for c in changes})
            outcome = Outcome("internal error", "process state changed: " + ", ".join(settings),
                              "\n".join(changes[:8]) + self._replay(self.overlapped[name], name),
                              outcome.step, outcome.calls)
        self.pending += [(name, j) for j in made if _tiered(j)]
        return outcome

    @staticmethod
    def _replay(before: list[str], name: str, after: list[str] = ()) -> str:
        """The programs ``name`` ran beside, and the command that runs them again in order."""
        before, after = before[-8:], list(after)[:8]
        text = (f"\nfused compiles under way meanwhile: {', '.join(before)}" if before else
                "\nno fused compile of another program was under way")
        if after:
            text += f"\nprograms run while it compiled: {', '.join(after)}"
        return text + ("\nreplay: python -m keraunos.testing.fuzz --back-to-back "
                       + " ".join(f"--only {n}" for n in [*before, name, *after]))

    def collect(self, timeout: float = 0.0) -> None:
        """Check the programs whose fused compiles are done; drop them."""
        deadline = time.monotonic() + timeout
        still = []
        for name, jitted in self.pending:
            left = max(0.0, deadline - time.monotonic())
            if not keraunos.wait_for_fusion(jitted, left):
                still.append((name, jitted))
                continue
            failures = fusion_failures(jitted)
            outcome = self.report.outcomes.get(name)
            if failures and outcome is not None and outcome.status not in ("mismatch",
                                                                           "internal error"):
                kind, _, text = failures[0].partition(": ")
                self.report.outcomes[name] = Outcome(
                    "internal error", f"fused tier failed: {kind}: {_cause(text)[:80]}",
                    "\n".join(failures[:4]) + self._replay(
                        self.overlapped.get(name, []), name,
                        self.order[self.order.index(name) + 1:]), outcome.step, outcome.calls)
        self.pending = still


def run_back_to_back(names: list[str], executors: list[str] | None = None, per_kind: int = 2,
                     progress=None, drain_s: float = 0.0, autocast: str | None = None) -> Report:
    """``BackToBack`` over ``names`` in order, in this process (no workers, no fork). Failures
    are printed as generated (shrinking a program alone would lose the programs it ran beside).
    ``drain_s``: after the last program, wait up to this long for the fused compiles still
    under way, to check them too."""
    start = time.monotonic()
    report = Report()
    with _campaign_settings(executors, "background", True, autocast, report):
        runner = BackToBack(report, compile_reference=_fused())
        for done, name in enumerate(names, 1):
            report.outcomes[name] = runner.run(name)
            if progress and done % 100 == 0:
                progress.write(f"{done}/{len(names)} programs\n")
        runner.collect(drain_s)
    _as_generated(report, report.failures, per_kind)
    _as_generated(report, report.rounding, per_kind)
    report.notes.append(f"back to back in one process: {runner.eager_warned} programs ended "
                        f"early because an eager step warned (warnings are errors there); "
                        f"{len(runner.pending)} programs' fused compiles still under way at the "
                        f"end (not checked)")
    errors = [(n, o) for n, o in report.outcomes.items() if o.status == "internal error"]
    if errors:
        report.notes.append("internal errors (replay: --back-to-back --only NAME, after the "
                            "programs each one names):")
        report.notes += [f"  {n}: {o.check}" for n, o in errors[:100]]
    report.seconds = time.monotonic() - start
    return report


def _as_generated(report, groups: dict, per_kind: int) -> None:
    """Reproducers of up to ``per_kind`` programs of each signature in ``groups``, unshrunk."""
    for signature, names_ in groups.items():
        report.reproducers[signature] = [generate(name).reproducer(str(report.outcomes[name]))
                                         for name in names_[:per_kind]]
