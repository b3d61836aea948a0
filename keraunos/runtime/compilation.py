"""What one compilation is asked for (``CompileRequest``) and what it has made so far
(``Compilation``): every trace each stage made, in order, and each stage's time."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..capture.symbolic import DynamicRequest
from ..core.trace import Trace


@dataclass
class CompileRequest:
    """What a miss asks ``pipeline.compile_entry`` to compile, beside the call itself.

    ``dynamic``: which of the call's sizes and ints capture may make symbolic, and what it
    learns of them (``capture/symbolic.py``; None: every size exact). ``predicted``: the
    program store's key's forecast of capture's answers to ``dynamic`` (``keeping.program_key``),
    which a stored program's load reports in capture's place and ``keeping.program_to_keep``
    checks capture answered alike."""

    dynamic: DynamicRequest | None = None
    predicted: DynamicRequest | None = None


@dataclass
class Compilation:
    """One compilation in progress: every trace each stage made, in order, and each stage's time
    (what ``last_traces`` and ``compile_stats`` show). A stage reads the latest traces and
    records the ones it makes (``record``)."""

    state: Any
    program: Any                               # capture's Program: the first three traces
    prologues: list[Trace]
    computations: list[Trace]
    epilogues: list[Trace]
    backwards: list[Trace] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    split: Any = None                          # the autograd split, when there is a backward
    records_autograd: bool = False             # no backward trace: torch's autograd records ops
    fusion_regions: list = field(default_factory=list)
    executors: tuple = ()                      # who claims lines (tier 0: no fusion executors)
    fusion_note: str | None = None             # why the program is not fused (compile_stats)
    # Inside DistributedDataParallel's forward: its bucket sizes, read when capture ran (the
    # fused tier's worker runs after the forward). The backward is then split at its bucket
    # boundaries (``stages.split_at_ddp_buckets``) into ``segments``.
    bucket_caps: Any = None
    segments: Any = None
    # Loaded from the program store (``persist/programs.py``) instead of captured; what the
    # store did with this compilation (compile_stats's ``program_store``); for a loaded one, the
    # captured facts make_entry needs: (number of inputs, the inputs it writes, the inputs the
    # prologue checks but does not hand on).
    loaded: bool = False
    program_store: str | None = None
    facts: tuple | None = None
    # For a loaded one: how the inputs of the call that captured it shared memory
    # (``cache.sharing_of``), which a call it serves must repeat.
    sharing: tuple | None = None
    # Where the fusion executors compile regions (``compiler.CompileSite``; None: here, now).
    site: Any = None
    request: CompileRequest = field(default_factory=CompileRequest)
    fast_prologue: Any = None  # the fast prologue's record (``fast_prologue.FastPrologue``)
    # The captured computation's inputs the prologue does not hand on (``drop_unused_inputs``).
    dropped_inputs: frozenset = frozenset()

    @property
    def computation(self) -> Trace:
        return self.computations[-1]

    @property
    def backward(self) -> Trace | None:
        return self.backwards[-1] if self.backwards else None

    def time(self, label: str, seconds: float) -> None:
        self.stages[label] = self.stages.get(label, 0.0) + seconds  # DCE runs twice: summed

    def record(self, label: str, *, computation: Trace | None = None,
               backward: Trace | None = None, prologue: Trace | None = None,
               epilogue: Trace | None = None, seconds: float | None = None) -> None:
        """The traces a stage made, each appended to its list, and the stage's time under
        ``label``: ``seconds``, else the computation's (or the backward's) own time."""
        for made, into in ((prologue, self.prologues), (computation, self.computations),
                           (epilogue, self.epilogues), (backward, self.backwards)):
            if made is not None:
                into.append(made)
        if seconds is None:
            seconds = (computation or backward).seconds
        self.time(label, seconds)

    def each_backward(self, change: Callable[[Trace], Trace]) -> float:
        """``change`` applied to the backward that runs: each of its segments where the backward
        is split at DDP's buckets (``segments``), else the backward trace (recorded); the time
        it took."""
        t0 = time.perf_counter()
        if self.segments is not None:
            for segment in self.segments.segments:
                segment.trace = change(segment.trace)
        elif self.backward is not None:
            self.backwards.append(change(self.backward))
        return time.perf_counter() - t0
