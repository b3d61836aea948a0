"""One knob for inspection: ``KERAUNOS_DEBUG``.

- ``KERAUNOS_DEBUG=1``: every compilation is logged through ``logging`` (logger ``"keraunos"``):
  what was compiled (the callable, its inputs), why the cache missed (one reason per existing
  entry), and how long each compile stage took.
- ``KERAUNOS_DEBUG=2``: also writes every trace after every pass as a ``.py`` file into a folder,
  one subfolder per compilation. The folder is logged when the first file is written; set
  ``KERAUNOS_DEBUG_DIR`` to choose it.
- ``KERAUNOS_DEBUG=3``: also the fusion regions of entries compiled with the inductor executor
  (``executors=["inductor", "torch"]``): each region's trace, FX graph and Inductor's generated
  kernel code, written under ``fusion/``.

Nothing here runs on a cache hit: ``compiled`` is called once per compilation, at the end of the
miss path. Every compilation is also remembered (the last ``HISTORY`` per jitted callable), with
its miss reasons, for ``keraunos.report``.

    >>> import os, torch, keraunos
    >>> os.environ["KERAUNOS_DEBUG"] = "1"   # or set it in the shell
    >>> jf = keraunos.jit(lambda x: x.sin() + 1)
    >>> _ = jf(torch.randn(3))               # logs "keraunos: compiled <lambda> ..."  # doctest: +SKIP
"""
from __future__ import annotations

import enum
import itertools
import logging
import os
import re
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from .core.glue import is_glue

logger = logging.getLogger("keraunos")

HISTORY = 64  # compilations remembered per jitted callable (summaries; entries held weakly)


class DebugLevel(enum.IntEnum):
    OFF = 0
    COMPILATIONS = 1  # log each compilation
    TRACES = 2        # and write every trace after every pass
    KERNELS = 3       # and the fusion regions' kernels


def level() -> DebugLevel:
    """The level ``KERAUNOS_DEBUG`` asks for now (read on every compilation, so it can be changed
    while a program runs)."""
    raw = os.environ.get("KERAUNOS_DEBUG", "0").strip() or "0"
    try:
        return DebugLevel(max(0, min(int(raw), int(DebugLevel.KERNELS))))
    except ValueError:
        return DebugLevel.COMPILATIONS  # KERAUNOS_DEBUG=yes: the user wants something


@dataclass
class Compilation:
    """One compilation of a jitted callable: the entry it made and why it was needed.

    The entry is held weakly: an entry the cache evicts is freed with its traces (the memory of a
    long-running program must not grow with its compilations); what stays is this summary."""

    number: int               # 1 for the callable's first compilation
    entry_ref: Callable       # weak reference to the CacheEntry
    stages: dict              # its compile stage times, kept after it is evicted
    miss_reasons: list[str]   # why each entry cached before it did not fit the call
    wall_time: float          # time.time() when it finished
    folder: str | None = None  # where KERAUNOS_DEBUG=2 wrote its traces
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, number: int, entry, miss_reasons: list[str], wall_time: float) -> "Compilation":
        return cls(number, weakref.ref(entry), dict(entry.stages), miss_reasons, wall_time)

    @property
    def entry(self):
        """The CacheEntry, or None once the cache evicted it and it was freed."""
        return self.entry_ref()


_history: "weakref.WeakKeyDictionary[object, list[Compilation]]" = weakref.WeakKeyDictionary()
_folder: list[str] = []  # this process's debug folder, made on first use
_folder_numbers = itertools.count(1)


def compilations(state) -> list[Compilation]:
    """The remembered compilations of a jitted callable's state, oldest first."""
    return list(_history.get(state, ()))


def compiled(state, entry) -> None:
    """Called by the miss path once ``entry`` is compiled for ``state``: remember it, and log and
    write it as ``KERAUNOS_DEBUG`` asks."""
    records = _history.setdefault(state, [])
    record = Compilation.of(state.misses, entry, list(state.last_miss_reasons), time.time())
    records.append(record)
    del records[:max(0, len(records) - HISTORY)]
    wanted = level()
    if wanted >= DebugLevel.TRACES:
        try:
            record.folder = write_traces(state.name, record, wanted)
        except OSError as e:  # a full disk or a read-only folder must not break the program
            _ensure_visible()
            logger.warning("keraunos: KERAUNOS_DEBUG=%d could not write traces: %s", int(wanted), e)
    if wanted >= DebugLevel.COMPILATIONS:
        _ensure_visible()
        logger.info("%s", describe(state.name, record))


def describe(name: str, record: Compilation) -> str:
    """The log message of one compilation: what, why, and where the time went."""
    entry = record.entry
    lines = [f"keraunos: compiled {name} (compilation {record.number}): "
             f"{_inputs_summary(entry)}"]
    if record.miss_reasons:
        per_entry, symbolic = split_reasons(record.miss_reasons)
        lines.append("  why: no cached entry fits the call:")
        lines += [f"    entry {i}: {reason}" for i, reason in enumerate(per_entry)]
        lines += [f"    so: {note}" for note in symbolic]
    else:
        lines.append("  why: first call (the cache was empty)")
    stages = entry.stages
    total = sum(stages.values())
    lines.append(f"  stages ({total * 1e3:.2f} ms in all):")
    width = max((len(s) for s in stages), default=0)
    lines += [f"    {stage:<{width}}  {seconds * 1e3:8.2f} ms" for stage, seconds in stages.items()]
    if record.folder:
        lines.append(f"  traces written to {record.folder}")
    return "\n".join(lines)


SYMBOLIC_NOTE = "; recompiled with it symbolic"  # what jit._compile appends to the reasons


def split_reasons(reasons: list[str]) -> tuple[list[str], list[str]]:
    """A miss's reasons as (one per cached entry, what changed and was compiled as a symbol):
    the miss path appends the second kind to the first, and they must not be numbered as
    entries."""
    per_entry = [r for r in reasons if not r.endswith(SYMBOLIC_NOTE)]
    return per_entry, [r for r in reasons if r.endswith(SYMBOLIC_NOTE)]


def format_duration(seconds: float, ascii_only: bool = True) -> str:
    """One duration in the unit that reads best: us below a millisecond, ms below a second, s
    above (``ascii_only=False`` writes the micro sign, for HTML)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} {'us' if ascii_only else '&micro;s'}"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def format_compile_stats(stats) -> str:
    """``str(keraunos.compile_stats(jitted))``: the compile stages of the entry that ran last
    (one unit for the column, so that the stages compare at a glance), what the last call's
    cache lookup did and cost, and the counters since the callable was made."""
    label_width = max([len(s) for s in (*stats.stages, *(stats.fusion_stages or ()))]
                      + [len("total compile")])
    lines = ["compile stages of the entry that ran last (ms):"]
    lines += [f"  {name:<{label_width}}  {seconds * 1e3:9.2f}"
              for name, seconds in stats.stages.items()]
    lines.append(f"  {'total compile':<{label_width}}  {stats.compile_time * 1e3:9.2f}")
    lookup = format_duration(stats.last_cache_lookup)
    if stats.last_call_compiled:
        lines.append(f"last call: a cache miss: no cached entry fitted (looking took {lookup}), "
                     f"so it compiled a new entry: the stages above")
    else:
        lines.append(f"last call: a cache hit: the cache lookup (prologue checks) took {lookup}")
    if stats.fusion_stages:
        lines.append("fused tier, compiled in the background (ms):")
        lines += [f"  {name:<{label_width}}  {seconds * 1e3:9.2f}"
                  for name, seconds in stats.fusion_stages.items()]
    if stats.fusion_pending:
        lines.append("tier: torch (eager's kernels) while the fused program compiles in the "
                     "background")
    elif stats.fused_from_call is not None:
        lines.append(f"tier: {stats.tier}; the fused program was ready after "
                     f"{format_duration(stats.fusion_seconds or 0.0)}, and calls after call "
                     f"{stats.fused_from_call} run it")
    else:
        lines.append(f"tier: {stats.tier}" + (f" ({stats.fusion_note})" if stats.fusion_note
                                                else ""))
    if stats.hit_path is not None:
        lines.append(f"hit path: {stats.hit_path}")
    if stats.kernel_build is not None:
        lines.append(f"fused kernels built: {stats.kernel_build}")
    store = getattr(stats, "program_store", None)
    if store == "loaded":
        lines.append("program store: loaded (no capture ran; its prologue accepted the call)")
    elif store is not None:
        lines.append(f"program store: {store}")
    misses = f"{stats.cache_misses} cache miss{'' if stats.cache_misses == 1 else 'es'}"
    hits = f"{stats.cache_hits} cache hit{'' if stats.cache_hits == 1 else 's'}"
    lines.append(f"calls so far: {hits}, {misses} (each miss compiles an entry)")
    return "\n".join(lines)


def _inputs_summary(entry) -> str:
    traces = entry.computation_traces
    if not traces:
        return "no traces"
    params = [p for p in traces[0].params if hasattr(p, "name")]
    described = [f"{p.name}: {p.describe()}" for p in params[:6] if hasattr(p, "describe")]
    more = f", and {len(params) - 6} more" if len(params) > 6 else ""
    ops = sum(1 for b in traces[-1].bound_symbols if not is_glue(b))
    backward = ", with a backward trace" if entry.backward_traces else ""
    return f"{len(params)} inputs ({', '.join(described)}{more}), {ops} ops{backward}"


# ------------------------------------------------------------------------- traces on disk
def debug_folder() -> str:
    """The folder ``KERAUNOS_DEBUG=2`` writes into, made (and logged) on first use."""
    if not _folder:
        chosen = os.environ.get("KERAUNOS_DEBUG_DIR")
        if chosen:
            os.makedirs(chosen, exist_ok=True)
        else:
            chosen = tempfile.mkdtemp(prefix="keraunos-debug-")
        _folder.append(chosen)
        _ensure_visible()
        logger.info("keraunos: KERAUNOS_DEBUG=%d writes every trace after every pass into %s",
                    int(level()), chosen)
    return _folder[0]


def trace_label(trace) -> str:
    """What made this trace: the pass named on its last header line ("capture" for the first)."""
    if not trace.header:
        return trace.name
    return trace.header[-1].removeprefix("Constructed by ").split(" (took ")[0]


def trace_histories(entry) -> dict[str, list]:
    """The traces of a cache entry by kind, each list in pass order."""
    return {"prologue": list(entry.prologue_traces), "computation": list(entry.computation_traces),
            "epilogue": list(entry.epilogue_traces), "backward": list(entry.backward_traces)}


def write_traces(name: str, record: Compilation, wanted: DebugLevel) -> str:
    folder = os.path.join(debug_folder(),
                          f"{next(_folder_numbers):03d}_{_slug(name)}_compilation{record.number}")
    os.makedirs(folder, exist_ok=True)
    for kind, traces in trace_histories(record.entry).items():
        for i, trace in enumerate(traces):
            path = os.path.join(folder, f"{kind}_{i:02d}_{_slug(trace_label(trace))}.py")
            with open(path, "w") as f:
                f.write(str(trace))
    if wanted >= DebugLevel.KERNELS:
        write_fusion_kernels(folder, record.entry)
    with open(os.path.join(folder, "compilation.txt"), "w") as f:
        f.write(describe(name, record) + "\n")
    return folder


def write_fusion_kernels(folder: str, entry) -> None:
    """Each fusion region's trace, FX graph and generated kernel source."""
    regions = getattr(entry, "fusion_regions", None) or ()
    if not regions:
        return
    fusion = os.path.join(folder, "fusion")
    os.makedirs(fusion, exist_ok=True)
    for i, region in enumerate(regions):
        name = _slug(getattr(region, "name", f"region{i}"))
        with open(os.path.join(fusion, f"{i:02d}_{name}.py"), "w") as f:
            f.write(str(getattr(region, "source", region)))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()[:60] or "trace"


def _ensure_visible() -> None:
    """Make the log visible when the user asked for it but configured no logging."""
    if logger.level == logging.NOTSET:  # a level the user set is theirs
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
