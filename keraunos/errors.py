"""Errors keraunos raises, and how it points at the user's own code."""
from __future__ import annotations

import linecache
import os
import sys

import torch

from .core.symbols import Source

_TORCH_DIR = os.path.dirname(torch.__file__)
_KERAUNOS_DIR = os.path.dirname(__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)
# Programs shipped with keraunos (the example GPT) are user code: their lines are what a trace
# should attribute ops to, even though they live inside the package.
_USER_DIRS_INSIDE_KERAUNOS = (os.path.join(_KERAUNOS_DIR, "examples") + os.sep,)


def is_internal(filename: str, skip_stdlib: bool = True) -> bool:
    """Whether a frame of this file is machinery (torch, keraunos, generated traces), not the
    user's program."""
    if filename.startswith(_KERAUNOS_DIR):
        return not filename.startswith(_USER_DIRS_INSIDE_KERAUNOS)
    return (filename.startswith(_TORCH_DIR) or filename.startswith("<frozen")
            or filename.startswith("<keraunos")
            or (skip_stdlib and filename.startswith(_STDLIB_DIR)))


class KeraunosError(Exception):
    """Base class of the errors keraunos raises about the user's program or inputs."""


class CaptureError(KeraunosError):
    """The program does something capture cannot turn into a trace (control flow on tensor data,
    an output shape that depends on data, an operation no kernel can describe)."""


class DataDependentError(CaptureError):
    """A Python decision on tensor data (``if x.sum() > 0``, ``.item()``): the program cannot be
    one trace. ``torch.compile(model, backend="keraunos")`` splits it at such decisions, and
    ``keraunos.jit`` takes that route by itself (its default ``fallback="dynamo"``); with
    ``fallback="error"`` it raises this."""


class FunctionTransformError(CaptureError):
    """The program applies a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ...), which
    capture does not record yet; like a ``DataDependentError`` it takes the ``fallback`` route
    (``torch.compile(backend="keraunos")`` traces these transforms)."""


class UnsupportedInputError(KeraunosError, TypeError):
    """An argument of a type keraunos cannot check on later calls."""


def user_source(skip_frames: int = 1) -> Source | None:
    """The innermost frame of the call stack that is the user's code (not torch, not keraunos)."""
    frame = sys._getframe(skip_frames)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal(filename):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return Source(filename, frame.f_lineno, code)
        frame = frame.f_back
    return None


def user_source_from_traceback(tb) -> Source | None:
    """The innermost frame of a traceback that is the user's code."""
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not is_internal(filename, skip_stdlib=False):
            code = linecache.getline(filename, tb.tb_lineno).strip()
            found = Source(filename, tb.tb_lineno, code)
        tb = tb.tb_next
    return found
