"""keraunos: a source-to-source JIT compiler for PyTorch.

    >>> import torch, keraunos
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> jmodel = keraunos.jit(model)
    >>> out = jmodel(torch.randn(2, 8))
    >>> print(keraunos.last_traces(jmodel)[-1])  # doctest: +SKIP
"""
from __future__ import annotations

from . import executors
from .core.tags import STATIC_MEMORY_LOCATION, Tag
from .core.trace import Trace
from .errors import CaptureError, DataDependentError, KeraunosError, UnsupportedInputError
from .runtime.structure import invalidate_module_structure
from .runtime.call import CacheMode, CompileStats, Fallback, state_of
from .runtime.jitted import JittedFunction, JittedModule, jit
from .capture.symbolic import mark_dynamic, mark_static
from .report import report
from .transforms import Transform
from .inspection import (cache_hits, cache_misses, compile_stats, last_backward_traces,
                         last_cache_miss_reasons, last_epilogue_traces, last_fusions,
                         last_prologue_traces, last_traces, wait_for_fusion)
from .version import __version__  # noqa: F401
from .version import warn_if_untested as _warn_if_untested
from .runtime.call import set_dynamo_backend


def _dynamo_backend():
    from .dynamo import backend  # imports dynamo: only when a program falls back
    return backend


set_dynamo_backend(_dynamo_backend)  # the fallback route: this package sits above both layers

__all__ = [
    "jit", "Transform", "Tag", "STATIC_MEMORY_LOCATION", "Trace", "CaptureError",
    "DataDependentError", "KeraunosError", "UnsupportedInputError", "CacheMode", "CompileStats", "Fallback", "JittedFunction", "JittedModule",
    "last_traces", "last_prologue_traces", "last_epilogue_traces", "last_backward_traces",
    "last_fusions", "wait_for_fusion",
    "cache_hits", "cache_misses", "last_cache_miss_reasons", "compile_stats", "executors",
    "invalidate_module_structure", "report", "mark_dynamic", "mark_static", "state_of",
]

_warn_if_untested()  # once: a torch release keraunos is not tested on
