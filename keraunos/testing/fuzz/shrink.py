"""Shrinking a failing program: drop steps, statements, returned items and members while the
same failure (status and check) persists."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from .drive import run_program
from .side import Outcome
from .program import Call, Program

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
        for param in best[0].params:
            changed |= still_fails(_without_param(best[0], param))
        for i, step in enumerate(best[0].steps):
            if isinstance(step, Call):
                lines = step.source.splitlines()
                _shrink_items(lines, lambda kept: still_fails(_with_call_source(best[0], i, kept)))
        if best[0].structure != "single" and len(best[0].returns) <= 1:
            still_fails(best[0].with_(structure="single"))
    return best


def _without_param(program: Program, param: str) -> Program:
    steps = []
    for step in program.steps:
        if isinstance(step, Call):
            keywords = dict(step.kwargs)
            positional = [p for p in program.params if p not in keywords]
            args = step.args
            if param in positional and positional.index(param) < len(args):
                i = positional.index(param)
                args = args[:i] + args[i + 1:]
            step = replace(step, args=args, kwargs=tuple((k, v) for k, v in step.kwargs if k != param))
        steps.append(step)
    return program.with_(params=tuple(p for p in program.params if p != param), steps=tuple(steps))


def _with_call_source(program: Program, index: int, lines: list[str]) -> Program:
    steps = list(program.steps)
    steps[index] = replace(steps[index], source="\n".join(lines))
    return program.with_(steps=tuple(steps))


def _shrink_field(program: Program, field: str, still_fails) -> None:
    _shrink_items(list(getattr(program, field)),
                  lambda kept: still_fails(program.with_(**{field: tuple(kept)})))


def _shrink_items(items: list, still_fails) -> list:
    """Remove chunks of ``items`` while ``still_fails(kept)``, halving the chunk size down to
    single items; returns what is kept."""
    chunk = max(1, len(items) // 2)
    while items:
        i = 0
        while i < len(items):
            candidate = items[:i] + items[i + chunk:]
            if still_fails(candidate):
                items = candidate
            else:
                i += chunk
        if chunk == 1:
            break
        chunk = max(1, chunk // 2)
    return items
