"""Guards: what the prologue must check for a cached program to be valid for a call.

Capture records a guard for every value the program's behaviour depended on: Python values by
value, containers by type and length or keys, objects by identity, tensors by metadata, global
state. The prologue builder turns them into checks; ``description`` is what a cache-miss
explanation says when the check fails.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from ..core.provenance import Path

# Values compared by equality (after an exact type check).
PLAIN_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size,
               slice, type(Ellipsis), torch.memory_format, torch.layout)
if torch.distributed.is_available():  # dist.ReduceOp.SUM, an argument of the collectives
    PLAIN_TYPES += (torch.distributed.ReduceOp.RedOpType,)


def is_plain(value: Any) -> bool:
    if isinstance(value, PLAIN_TYPES) or isinstance(value, enum.Enum):
        return True
    if type(value) in (tuple, list):
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


@dataclass
class Guard:
    """One check. ``kind`` is value, identity, type, length, keys, or global (``path`` is None and
    ``expression`` is the global state read, e.g. ``torch.is_grad_enabled()``)."""

    kind: str
    path: Path | None
    expected: Any
    expression: str | None = None
    from_module: bool = False

    @property
    def description(self) -> str:
        where = self.expression if self.path is None else str(self.path)
        if self.kind == "data":
            return (f"{where} == {self.expected!r}, a value read from tensor data at "
                    f"{self.source} (specialize_data=True)")
        if self.kind == "ambient":
            return "the ambient state (grad mode, autocast, ...) is as when compiled"
        if self.kind == "value" or self.kind == "global":
            return f"{where} == {self.expected!r} ({type(self.expected).__name__})"
        if self.kind == "identity":
            if hasattr(self.expected, "proxy"):  # a tensor reached two ways (tied weights)
                return f"{where} is the same tensor as {self.expected.path}"
            return f"{where} is the same object as when compiled ({type(self.expected).__name__})"
        if self.kind == "symbolic int":
            return f"{where} is an int (compiled as the symbol {self.expected.name})"
        if self.kind == "absent attribute":
            return f"{where} does not exist"
        if self.kind == "absent":
            return f"{where} does not exist"
        if self.kind == "type":
            return f"type({where}) is {self.expected.__qualname__}"
        if self.kind == "length":
            python_type, n = self.expected
            return f"{where} is a {python_type.__name__} of length {n}"
        if self.kind == "keys":
            python_type, keys = self.expected
            if not keys:
                return f"{where} is empty"
            return f"{where} is a {python_type.__name__} with keys {list(keys)}"
        raise AssertionError(self.kind)
