"""Cache entries and cache modes: what a jitted callable keeps per compiled program."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..core import glue
from ..core.trace import Trace
from ..torch_internals import dispatch


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
    # What the fast prologue made (``fast_prologue.FastPrologue``): the record the hit paths and
    # rebinding read; None for the torch.compile fallback's entry, whose prologue checks nothing
    # (dynamo's guards do).
    fast_prologue: object = None
    # The names of tensors the prologue checks but does not hand on (an old gradient that
    # ``zero_grad`` only compared with None): the hit path lets go of them before the computation.
    released: tuple = ()
    computation_fn: Callable  # replaced once, by the switch to the fused tier (runtime/tiers.py)
    epilogue_fn: Callable
    prologue_traces: list[Trace] = field(default_factory=list)
    computation_traces: list[Trace] = field(default_factory=list)
    epilogue_traces: list[Trace] = field(default_factory=list)
    backward_traces: list[Trace] = field(default_factory=list)
    check_descriptions: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    # The storage sharing of the tensor inputs it was compiled for (None: every tensor input has
    # memory of its own); set by the first call (runtime/call.py), which knows the real inputs.
    alias_pattern: tuple | None = None
    hits: int = 0
    # Which inputs the alias check compares (None: at most one tensor), and which the program
    # writes to (only then, or when inputs shared memory, does sharing matter; None: unknown,
    # an op of unknown effect or a write without a copy).
    alias_positions: tuple | None = None
    written_positions: tuple | None = None
    # For an entry compiled with grad mode on: ``(position, is a view)`` of each tensor input it
    # writes, on the compiling call. Autograd's in-place rules tell a view from a tensor of its
    # own (writing a value that requires grad into a view of a base, then writing it again in
    # place, raises where the same writes to a plain tensor do not), so the alias check
    # compares them too.
    written_views: tuple = ()
    # check_storage_aliases' strategy for this entry, chosen once when it is compiled.
    alias_check: Callable = lambda inputs: True
    # The hit path (hit_path.hit_path): checks, computation and epilogue in one generated function,
    # made once the alias check is chosen; its trace (None for the fallback's entry), and
    # what the prologue's checks took on the compiling call (``compile_stats`` on such a hit).
    hit_fn: Callable = lambda args, kwargs: "no hit path yet"
    hit_trace: Trace | None = None
    check_seconds: float = 0.0
    # The native hit path's ``Hit`` of this entry, made once a jitted function's native
    # ``__call__`` first serves it (jit._native_hit): None where it cannot serve it.
    native_hit: object = NOT_ASKED
    native_note: str | None = None   # why the native hit path does not serve it
    fusion_regions: list = field(default_factory=list)  # keraunos.last_fusions
    fusion_note: str | None = None   # why the program was not fused, when it could have been
    tiering: object = None           # tiers.Tiering: the fused tier compiling in the background
    program_store: str | None = None  # loaded from / kept in the program store, or why not


def sharing_cannot_matter(inputs) -> bool:
    """The alias check of an entry whose inputs' sharing cannot change what it computes (no
    input is written, none shared memory when it was compiled): the hit path leaves it out."""
    return True



def returns_the_only_output(epilogue: Trace) -> bool:
    """The epilogue is ``t, = outputs; return t``: the computation's outputs are ``(result,)``."""
    *unpacks, ret = epilogue.bound_symbols
    if ret.symbol is not glue.RETURN_VALUE or any(b.symbol is not glue.UNPACK_OUTPUTS
                                                  for b in unpacks):
        return False
    outputs = [b.outputs for b in unpacks if b.fields.origin == "outputs"]
    from_prologue = [b.outputs for b in unpacks if b.fields.origin == "pro_to_epi"]
    return (len(outputs) == 1 and len(outputs[0]) == 1 and not any(from_prologue)
            and len(ret.args) == 1 and ret.args[0] is outputs[0][0])


# ------------------------------------------------------------- how an entry's inputs share memory
def tensor_positions(entry: CacheEntry, inputs: Sequence) -> tuple | None:
    """The positions among ``entry.alias_positions`` that hold tensors on this call (not sizes);
    None when fewer than two do (nothing can be shared)."""
    positions = tuple(i for i in entry.alias_positions or ()
                      if isinstance(inputs[i], torch.Tensor))
    return positions if len(positions) > 1 else None


def sharing_of(entry: CacheEntry, inputs: Sequence) -> tuple | None:
    """How the tensors among ``inputs`` (what the entry's prologue returned for a call) share
    memory: the ``alias_pattern`` an entry compiled on that call would get. A program that
    another call compiled (loaded from the program store, rebound from an identical module)
    serves this one only where the two are equal, as its alias check would decide."""
    positions = tensor_positions(entry, inputs)
    if positions is None:
        return None
    return storage_alias_pattern([inputs[i] for i in positions])


_is_alias_of = dispatch.is_alias_of
_storage_id = dispatch.storage_id  # the StorageImpl: what _is_alias_of compares


def storage_alias_pattern(inputs: Sequence) -> tuple | None:
    """For each tensor, the index of the first one sharing its storage and its offset in it;
    ``None`` when nothing is shared (the common case, compared cheaply)."""
    if len(inputs) <= 4:  # a few tensors: compare them pairwise
        if not any(_is_alias_of(a, b) for i, a in enumerate(inputs) for b in inputs[i + 1:]):
            return None
    storages = list(map(_storage_id, inputs))  # one C loop: the hit path of writing modules
    if len(set(storages)) == len(storages):
        return None
    first: dict[int, int] = {}
    # Views at other offsets are different programs when the inputs are rebuilt from one storage.
    return tuple((first.setdefault(s, i), inputs[i].storage_offset())
                 for i, s in enumerate(storages))
