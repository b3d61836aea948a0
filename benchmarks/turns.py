"""Timing in turns, shared by the benchmark scripts: every system (or variant) makes one call
per round, round after round, so that a busy machine slows them alike and only ratios measured
in one run are compared."""
from __future__ import annotations

import statistics
import time


def samples_in_turns(calls: dict, rounds: int) -> dict:
    """Each call's times in seconds, one per round: name -> list."""
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return samples


def medians_in_turns(calls: dict, rounds: int) -> dict:
    """Each call's median time in seconds over ``rounds`` rounds in turns: name -> float."""
    return {name: statistics.median(s) for name, s in samples_in_turns(calls, rounds).items()}
