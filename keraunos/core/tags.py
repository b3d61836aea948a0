"""Tags: named markers that proxies and bound symbols carry through every pass.

The registry is open: ``Tag.register("MY_TAG")`` creates (or returns) a tag that a user's
``Transform`` can set and read. Passes copy tags along with the values they rewrite.
"""
from __future__ import annotations


class Tag:
    """A named marker. Tags compare by identity; ``Tag.register`` returns the one tag of a name."""

    _registry: dict[str, "Tag"] = {}

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Tag.{self.name}"

    @classmethod
    def register(cls, name: str) -> "Tag":
        tag = cls._registry.get(name)
        if tag is None:
            tag = cls._registry[name] = cls(name)
        return tag

    @classmethod
    def all(cls) -> dict[str, "Tag"]:
        return dict(cls._registry)


# A parameter or buffer of a module: a tensor whose memory lives in the model, not in the call.
STATIC_MEMORY_LOCATION = Tag.register("STATIC_MEMORY_LOCATION")
# A tensor argument of the call (args / kwargs).
INPUT_TENSOR = Tag.register("INPUT_TENSOR")
# A bound symbol that draws from the random number generator: never removed, never merged.
RANDOM = Tag.register("RANDOM")
# A bound symbol that writes to a tensor or to global state: never removed, never merged.
MUTATION = Tag.register("MUTATION")
# A prologue check derived only from the module (parameters, buffers, attributes, submodule types).
MODULE_CHECK = Tag.register("MODULE_CHECK")
# A bound symbol for an op no fake kernel describes: run as is, its effects unknown to passes.
OPAQUE = Tag.register("OPAQUE")
# A line recorded under autocast whose casts are not explicit lines of the trace: what it
# computes depends on autocast being on where it runs (``capture/recorder.py``).
UNDER_AUTOCAST = Tag.register("UNDER_AUTOCAST")
# The copy capture makes of an input the program writes to (the computation stays pure; the
# epilogue copies the result back). Reinplace turns it into an alias where autograd cannot see.
COPY_OF_WRITTEN_INPUT = Tag.register("COPY_OF_WRITTEN_INPUT")
# A prologue line that needs the module structure loaded first (it reads a buffer, or tensor
# data): the fast prologue places it after the cached module walk.
AFTER_STRUCTURE = Tag.register("AFTER_STRUCTURE")
