"""Code generation: a compilation's traces become the Python functions a cache entry holds."""
from __future__ import annotations

import time

from ..autograd import make_autograd_computation
from ..autograd.function import make_segmented_computation
from ..core.proxies import TensorProxy
from ..core.tags import COPY_OF_WRITTEN_INPUT, OPAQUE
from ..core.trace import Trace
from .cache import CacheEntry
from .compilation import Compilation
from .tiers import Tiering

def make_entry(c: Compilation, tiering: Tiering | None = None) -> CacheEntry:
    """Code generation: the traces become Python functions, held by a new cache entry."""
    t0 = time.perf_counter()
    prologue_fn = c.prologues[-1].python_callable()
    computation_fn = computation_callable(c)
    epilogue_fn = c.epilogues[-1].python_callable()
    c.time("codegen", time.perf_counter() - t0)
    n_inputs, written, released = c.facts if c.facts is not None else captured_facts(c)
    positions = tuple(range(n_inputs))
    entry = CacheEntry(prologue_fn=prologue_fn, computation_fn=computation_fn,
                       epilogue_fn=epilogue_fn, prologue_traces=c.prologues,
                       computation_traces=c.computations, epilogue_traces=c.epilogues,
                       backward_traces=c.backwards,
                       check_descriptions=c.program.check_descriptions, stages=c.stages,
                       alias_positions=positions if len(positions) > 1 else None,
                       written_positions=written,
                       fusion_regions=c.fusion_regions, fusion_note=c.fusion_note,
                       tiering=tiering, program_store=c.program_store,
                       fast_prologue=c.fast_prologue, released=released)
    return entry


def captured_facts(c: Compilation) -> tuple:
    """What make_entry needs of the captured computation: the number of inputs the prologue
    hands on, which of them it writes (``_written_positions``), and the names of those it
    checks but does not hand on (``stages.drop_unused_inputs``)."""
    captured = c.program.computation
    handed = [p for p in captured.params if getattr(p, "name", None) not in c.dropped_inputs]
    return len(handed), _written_positions(captured, handed), tuple(sorted(c.dropped_inputs))


def computation_callable(c: Compilation):
    computation_fn = c.computation.python_callable()
    if c.segments is not None:
        device = next(p.device for p in c.split.forward.params if isinstance(p, TensorProxy))
        return make_segmented_computation(
            computation_fn, [s.trace.python_callable() for s in c.segments.segments],
            c.segments, c.split, device)
    if c.backward is not None:
        computation_fn = make_autograd_computation(computation_fn,
                                                   c.backward.python_callable(boxed=True),
                                                   c.split)
    return computation_fn


def _written_positions(computation: Trace, handed: list) -> tuple | None:
    """The positions among the inputs ``handed`` on by the prologue of those the program writes
    to (it works on a copy of each), or ``None`` when that is not known (an op of unknown
    effect)."""
    index = {p.name: i for i, p in enumerate(handed)}
    written = []
    for b in computation.bound_symbols:
        if OPAQUE in b.tags:
            return None
        if COPY_OF_WRITTEN_INPUT in b.tags:  # capture copies every input written to
            written.append(index[b.args[0].name])
    return tuple(written)
