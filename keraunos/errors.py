"""Errors keraunos raises, and how it points at the user's own code."""
from __future__ import annotations

import functools
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
_USER_DIRS_INSIDE_KERAUNOS = (os.path.join(_KERAUNOS_DIR, "examples"),)
# Where installed libraries live when they are inside the standard library's directory (conda,
# a system Python: .../lib/python3.11/site-packages).
_SITE_DIR_NAMES = ("site-packages", "dist-packages")


def _inside(filename: str, directory: str) -> bool:
    """Whether ``filename`` is in ``directory`` or below it: a prefix of the whole directory
    name, so that torch's directory does not hold ``torchvision`` or ``torch_geometric``."""
    return filename.startswith(_as_prefix(directory))


@functools.lru_cache(maxsize=None)
def _as_prefix(directory: str) -> str:
    return os.path.join(directory, "")


def is_stdlib(filename: str) -> bool:
    if not _inside(filename, _STDLIB_DIR):
        return False
    first = os.path.relpath(filename, _STDLIB_DIR).split(os.sep, 1)[0]
    return first not in _SITE_DIR_NAMES


@functools.lru_cache(maxsize=4096)  # asked for every frame of every logging call at capture
def is_internal(filename: str, skip_stdlib: bool = True) -> bool:
    """Whether a frame of this file is machinery (torch, keraunos, generated traces, and unless
    ``skip_stdlib`` is false the standard library), not the user's program. Libraries built on
    torch (torchvision, a model zoo) are the user's program."""
    if _inside(filename, _KERAUNOS_DIR):
        return not any(_inside(filename, d) for d in _USER_DIRS_INSIDE_KERAUNOS)
    return (_inside(filename, _TORCH_DIR) or filename.startswith("<frozen")
            or filename.startswith("<keraunos")
            or (skip_stdlib and is_stdlib(filename)))


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


class ScopeMutationError(CaptureError):
    """The program changes a list, dict or set in its globals or a closure (``made.append(t)``):
    a cached program would not do it again on later calls. Capture undoes the change; like a
    ``DataDependentError`` it takes the ``fallback`` route (dynamo replays such changes)."""


class UnguardableStateError(CaptureError):
    """The program reads state of an object it finds by name (a global, a closure variable, a
    bound method's object) that keraunos cannot check on later calls (an ``OrderedDict`` of
    hooks, a ``defaultdict`` of tensors): compiled in, a later change would go unseen. Like a
    ``DataDependentError`` it takes the ``fallback`` route (dynamo guards such reads)."""


class FakeKernelError(CaptureError):
    """PyTorch's fake kernel of an op rejects a call its real kernel takes (``_foreach_addcdiv_``
    with a CPU tensor of scalars, as a foreach optimizer step makes under tracing): capture
    cannot tell what the call makes. Like a ``DataDependentError`` it takes the ``fallback``
    route."""


class LazyStateError(CaptureError):
    """The program adds entries to a mapping held by an object it finds by name, and changes
    nothing else there: state created on a first call (an optimizer's ``state[p]`` on its first
    step). A cached program would create it again on every call, so ``keraunos.jit`` runs this
    call eagerly (the state is then made for real) and captures on the next call; a program that
    does it again on that call takes the ``fallback`` route like a ``ScopeMutationError``."""


class CustomFunctionError(CaptureError):
    """A custom ``torch.autograd.Function`` runs inside the program on tensors that require grad
    (BLOOM's ``GeLUFunction``, ``checkpoint(..., use_reentrant=True)``, module backward hooks):
    the trace records its forward's ops, and its own backward would be lost. Like a
    ``DataDependentError`` it takes the ``fallback`` route, where Dynamo keeps the Function's
    backward."""


class TorchScriptModuleError(CaptureError):
    """The module tree holds a TorchScript module (``torch.jit.script(module)``,
    ``torch.jit.trace(module, ...)``): it runs in the TorchScript interpreter, which cannot run
    on capture's fake tensors, and it keeps no Python forward to capture instead (a
    ``torch.jit.script`` *function* does: capture runs that). Like a ``DataDependentError`` it
    takes the ``fallback`` route, where the TorchScript module runs as it is."""


class BackwardInProgramError(CaptureError):
    """The program runs autograd's backward itself (``loss.backward()``,
    ``torch.autograd.backward``, ``torch.autograd.grad``): a training step written as one
    function. Capture records the forward only; the gradients it would accumulate into ``.grad``
    and what reads them after (clipping, an optimizer's step) are not a program of one trace
    yet. Like a ``DataDependentError`` it takes the ``fallback`` route, where Dynamo breaks the
    graph at the backward and keraunos compiles the graphs around it."""


# What keraunos.jit(..., fallback="dynamo") hands to torch.compile(backend="keraunos").
FALLBACK_ERRORS = (DataDependentError, FunctionTransformError, ScopeMutationError,
                   UnguardableStateError, LazyStateError, FakeKernelError,
                   CustomFunctionError, TorchScriptModuleError, BackwardInProgramError)


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
