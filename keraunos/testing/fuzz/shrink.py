"""Shrinking a failing program: drop steps, statements, returned items and members while the
same failure (status and check) persists."""
from __future__ import annotations

import time
from typing import Callable

from .drive import Outcome, run_program
from .program import Program

FIELDS = ("steps", "body", "returns", "init", "header", "sub_body", "sub_init")


def shrink(program: Program, outcome: Outcome, run: Callable[[Program], Outcome] = run_program,
           budget_s: float = 60.0) -> tuple[Program, Outcome]:
    """The smallest program found (within ``budget_s``) that fails as ``outcome`` did."""
    deadline = time.monotonic() + budget_s
    best = (program, outcome)

    def still_fails(candidate: Program) -> bool:
        nonlocal best
        if time.monotonic() > deadline:
            return False
        result = run(candidate)
        if result.signature == outcome.signature:
            best = (candidate, result)
            return True
        return False

    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for field in FIELDS:
            before = getattr(best[0], field)
            _shrink_field(best[0], field, still_fails)
            changed |= getattr(best[0], field) != before
        if best[0].structure != "single" and len(best[0].returns) <= 1:
            still_fails(best[0].with_(structure="single"))
    return best


def _shrink_field(program: Program, field: str, still_fails) -> None:
    """Remove chunks of the field's items, halving the chunk size down to single items."""
    items = list(getattr(program, field))
    chunk = max(1, len(items) // 2)
    while items:
        i = 0
        while i < len(items):
            candidate = items[:i] + items[i + chunk:]
            if still_fails(program.with_(**{field: tuple(candidate)})):
                items = candidate
                program = program.with_(**{field: tuple(items)})
            else:
                i += chunk
        if chunk == 1:
            break
        chunk = max(1, chunk // 2)
