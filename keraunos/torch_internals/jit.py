"""TorchScript: the Python function a ``torch.jit.script`` function was made from.

``torch.jit.script(fn)`` keeps ``fn`` on the function it returns, as ``_torchdynamo_inline``, for
Dynamo, which traces that Python instead of calling into the TorchScript interpreter; capture
does the same (``capture/interceptors.py``). The attribute is torch's own, unchanged from 2.13
to 2.15.
"""
from __future__ import annotations

from typing import Callable

import torch

SCRIPT_FUNCTION = torch.jit.ScriptFunction


def python_of(script_function) -> Callable | None:
    """The Python function ``script_function`` was scripted from, or None (a function compiled
    from source text, or loaded from a saved archive)."""
    return getattr(script_function, "_torchdynamo_inline", None)
