"""A differential fuzzer: generated programs run jitted and eagerly, compared after every step.

    >>> from keraunos.testing.fuzz import generate, run_program
    >>> outcome = run_program(generate("0:0"))
    >>> outcome.status in ("pass", "mismatch", "internal error", "refusal")
    True

``python -m keraunos.testing.fuzz --programs 1000 --seed 0`` runs many and prints a summary and
shrunk reproducers; docs/reliability.md describes the grammar, the state changes and the checks.
"""
from .drive import run_program
from .side import STATUSES, Outcome
from .generate import generate
from .program import Call, Change, Program
from .shrink import shrink


def replay(program: Program, make_jitted=None) -> Outcome:
    """Run a (printed, edited) program again; returns its outcome."""
    return run_program(program) if make_jitted is None else run_program(program, make_jitted)


__all__ = ["Call", "Change", "Outcome", "Program", "STATUSES", "generate", "replay", "run_program",
           "shrink"]
