"""Cache entries and cache modes: what a jitted callable keeps per compiled program."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from .core.trace import Trace


class _NotAsked:
    def __repr__(self) -> str:
        return "NOT_ASKED"


NOT_ASKED = _NotAsked()  # CacheEntry.native_hit before anyone asked


class CacheMode(enum.Enum):
    """How cache entries are checked against a call."""

    CONSTANT_VALUES = "constant values"  # numbers and shapes baked in, every one checked
    SYMBOLIC_VALUES = "symbolic values"  # every size and int symbolic (docs/symbolic.md)
    SAME_INPUT = "same input"            # the user promises identical metadata: no checks
    NO_CACHING = "no caching"            # compile on every call


@dataclass(kw_only=True)
class CacheEntry:
    """One compiled program behind its prologue's checks: the three callables a hit runs, every
    trace each stage made (``last_traces`` and friends), and what the call path keeps about it.
    Built with keywords; the fields a hit path changes later say so."""

    prologue_fn: Callable
    computation_fn: Callable  # replaced once, by the switch to the fused tier (tiers.py)
    epilogue_fn: Callable
    prologue_traces: list[Trace] = field(default_factory=list)
    computation_traces: list[Trace] = field(default_factory=list)
    epilogue_traces: list[Trace] = field(default_factory=list)
    backward_traces: list[Trace] = field(default_factory=list)
    check_descriptions: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    # The storage sharing of the tensor inputs it was compiled for (None: every tensor input has
    # memory of its own); set by the first call (jit.py), which knows the real inputs.
    alias_pattern: tuple | None = None
    hits: int = 0
    # Which inputs the alias check compares (None: at most one tensor), and which the program
    # writes to (only then, or when inputs shared memory, does sharing matter; None: unknown,
    # an op of unknown effect or a write without a copy).
    alias_positions: tuple | None = None
    written_positions: tuple | None = None
    # check_storage_aliases' strategy for this entry, chosen once when it is compiled.
    alias_check: Callable = lambda inputs: True
    # The hit path (hit_path.hit_path): checks, computation and epilogue in one generated function,
    # made once the alias check is chosen; its trace (None where it calls the prologue), and
    # what the prologue's checks took on the compiling call (``compile_stats`` on such a hit).
    hit_fn: Callable = lambda args, kwargs: "no hit path yet"
    hit_trace: Trace | None = None
    check_seconds: float = 0.0
    # The native hit path's ``Hit`` of this entry, made once a jitted function's native
    # ``__call__`` first serves it (jit._native_hit): None where it cannot serve it.
    native_hit: object = NOT_ASKED
    fusion_regions: list = field(default_factory=list)  # keraunos.last_fusions
    fusion_note: str | None = None   # why the program was not fused, when it could have been
    tiering: object = None           # tiers.Tiering: the fused tier compiling in the background
    program_store: str | None = None  # loaded from / kept in the program store, or why not
