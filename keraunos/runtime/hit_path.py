"""A cache entry's alias check and its hit path: what decides, on every call, whether the
most recently used entry serves it, and runs it when it does (``jit.call`` calls them; the
module docstring of ``runtime/call.py`` describes the call path they are the first part of)."""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch

from .cache import (CacheEntry, returns_the_only_output, sharing_cannot_matter,
                    storage_alias_pattern)
from ..core import glue
from ..core.trace import Trace
from .fast_prologue import FastPrologue, inputs_code
from ..torch_internals import dispatch


# ------------------------------------------------------------------------- storage aliases
_is_alias_of = dispatch.is_alias_of


def check_storage_aliases(entry: CacheEntry, inputs: Sequence) -> bool:
    """Whether the tensor inputs share memory exactly as they did when ``entry`` was compiled.

    Sharing only matters for an input the program writes to, or when inputs shared memory when
    it was compiled (a program that only reads computes eager's values whatever its inputs
    share). Nothing about it is cached across calls: ``p.data = t``, ``set_`` and
    ``swap_tensors`` change a parameter's memory without any hook. A written input whose
    storage nothing else refers to shares it with nobody, which is cheap to ask; otherwise every
    tensor input, parameters and buffers included, is compared."""
    return entry.alias_check(inputs)


_storage_use_count = dispatch.storage_use_count


def _alone(t: torch.Tensor) -> bool:
    # Two references: the tensor's and the temporary storage object's.
    return _storage_use_count(t.untyped_storage()._cdata) <= 2


def alias_check_for(entry: CacheEntry) -> Callable:
    """The cheapest check that is exact for this entry, decided once instead of on every call:
    of the inputs' sharing, and of which written inputs are views (``written_views``)."""
    sharing, views = _sharing_check_for(entry), entry.written_views
    if not views:
        return sharing

    def check(inputs):
        for i, view in views:
            if inputs[i]._is_view() is not view:
                return False
        return sharing(inputs)
    return check


def _sharing_check_for(entry: CacheEntry) -> Callable:
    positions, written = entry.alias_positions, entry.written_positions
    if positions is None or (entry.alias_pattern is None and written == ()):
        return sharing_cannot_matter
    if len(positions) == 2 and entry.alias_pattern is None:
        a, b = positions
        return lambda inputs: not _is_alias_of(inputs[a], inputs[b])
    if entry.alias_pattern is None and written is not None:
        # The storage's use count counts tensor objects: one tensor passed in two places is
        # "alone" by it, so those places are compared by identity too (fuzzer 30:1326): when
        # the tensors at ``positions`` are distinct objects (one set of their ids, built in C),
        # no written one is passed twice; otherwise the full comparison decides.
        tensors_at, written_at = _items_at(positions), _items_at(written)
        others = {i: tuple(j for j in positions if j != i) for i in written}

        def check(inputs):
            for t in written_at(inputs):
                if not _alone(t):
                    return alias_pattern_of(entry, inputs) is None
            if len(set(map(id, tensors_at(inputs)))) == len(positions):
                return True
            if any(inputs[j] is inputs[i] for i in written for j in others[i]):
                return alias_pattern_of(entry, inputs) is None
            return True  # only inputs the program reads are passed twice
        return check
    return lambda inputs: alias_pattern_of(entry, inputs) == entry.alias_pattern


def _items_at(positions: tuple) -> Callable:
    """``inputs -> tuple(inputs[i] for i in positions)``, in C."""
    if len(positions) == 1:
        i = positions[0]
        return lambda inputs: (inputs[i],)
    return operator.itemgetter(*positions)


def alias_pattern_of(entry: CacheEntry, inputs: Sequence):
    return storage_alias_pattern([inputs[i] for i in entry.alias_positions])


class ProgramRaised:
    """What a hit path returns when the program itself raised, after its checks passed: the
    caller raises ``error`` and never tries the call again (the program may have written to its
    inputs before it raised, and the prologue may then reject what it accepted)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def reraise(raised: ProgramRaised):
    """Raise the program's error, holding no reference to it from this frame afterwards (its
    traceback refers to the frame: a cycle that would keep the call's tensors alive)."""
    error, raised.error = raised.error, None
    try:
        raise error
    finally:
        error = None


# ------------------------------------------------------------------------------ hit paths
def hit_path(entry: CacheEntry) -> tuple[Callable, Trace | None]:
    """The entry's hit path and its trace: ``hit(args, kwargs)`` runs the fast prologue's lines,
    then, instead of returning the inputs, the alias check where sharing matters and the
    computation and epilogue, returning ``(result,)``. When the epilogue only hands back the one
    output, the computation's own ``(result,)`` is returned as it is. What the computation or the
    epilogue raise comes back as a ``ProgramRaised`` (a ``try`` costs nothing until something
    raises), so that the caller tells the program's errors from a check that could not run.
    ``runtime/call.py`` lists the outcomes."""
    made: FastPrologue = entry.fast_prologue
    prologue, inputs, pro_to_epi = made.trace, inputs_code(made.inputs), made.pro_to_epi
    alias_check = entry.alias_check

    def run(w):
        lines = []
        if alias_check is not sharing_cannot_matter:
            lines.append(f"if not {w.constant(alias_check, 'alias_check')}(({inputs},)): "
                         f"return 'the inputs share memory differently'")
        bound = {p.name for b in prologue.bound_symbols for p in b.output_proxies()}
        kept = {getattr(p, "name", None) for p in pro_to_epi}  # (the epilogue may return it)
        released = [name for name in entry.released if name in bound and name not in kept]
        if released:
            lines.append(f"del {', '.join(released)}  # checked, not handed on: its memory is "
                         f"free to go while the program runs")
        lines.append("try:")
        if returns_the_only_output(entry.epilogue_traces[-1]):
            lines.append(f"  return _entry.computation_fn({inputs})  # (result,): the epilogue "
                         f"only returns the one output")
        else:
            lines.append(f"  return (_entry.epilogue_fn(_entry.computation_fn({inputs}), "
                         f"{w.value(pro_to_epi)}),)")
        lines += ["except Exception as _program_error:",
                  "  return ProgramRaised(_program_error)  # raised by the caller, never retried"]
        return lines
    line = glue.PYTHON.bind(label="hit", lines=run, outputs=None, executor="python")
    trace = Trace("hit", ["args", "kwargs"], prologue.bound_symbols[:-1] + [line],
                  prologue.header + ["Constructed by Hit Path (runtime/hit_path.py): the prologue's checks, "
                                     "then the computation and the epilogue"],
                  {**prologue.namespace, "_entry": entry, "ProgramRaised": ProgramRaised})
    return trace.python_callable(), trace
