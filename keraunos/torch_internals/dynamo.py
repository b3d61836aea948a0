"""Dynamo's machinery: its C++ guards and eval-frame hook (part of torch's C extension, loaded
with torch), and the Python package (``torch._dynamo``), imported only when first used.

Owns ``GlobalStateGuard`` and ``TensorGuards`` (what a prologue checks in C++), the guard
manager types, the eval-frame callback (whether dynamo is compiling on this thread), the
decorator that keeps dynamo out of a function, and, lazily through this module's attributes,
dynamo's counters, ``OutputGraph``, ``ConstantSource``, its cache-entry list and ``reset``.

Release difference: the fields ``GlobalStateGuard`` serializes. Up to torch 2.14 they include
``allow_tf32``; from 2.15 ``cuda_matmul_precision`` takes its place (both derive from the CUDA
matmul float32 precision). ``GLOBAL_STATE_FIELDS`` holds every field of the supported releases;
``global_state_fields()`` those this torch's guard has.
"""
from __future__ import annotations

import json

import torch

from . import lazy

# Each None in a build without it (then every check it would make is made in Python).
_guards = getattr(torch._C, "_dynamo", None)
_guards = getattr(_guards, "guards", None)
GlobalStateGuard = getattr(_guards, "GlobalStateGuard", None)
TensorGuards = getattr(_guards, "TensorGuards", None)
RootGuardManager = getattr(_guards, "RootGuardManager", None)

eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
# ``@disable``: dynamo runs the function as it is, never tracing into it.
disable = torch._disable_dynamo

GLOBAL_STATE_FIELDS = frozenset({
    "grad_mode", "autocast_state", "torch_function", "torch_function_all_disabled",
    "deterministic_algorithms", "deterministic_algorithms_warn_only", "allow_tf32",
    "allow_fp16_reduce", "allow_bf16_reduce", "num_threads", "default_dtype",
    "cuda_matmul_precision"})
AUTOCAST_FIELDS = frozenset({"enabled", "dtype", "cached_enabled"})  # of "autocast_state"

# The names of the config modules of torch's compile stack (dynamo's, Inductor's, AOTAutograd's).
CONFIG_MODULES = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")


def global_state_fields() -> frozenset[str]:
    """The fields this torch's ``GlobalStateGuard`` compares (empty without one)."""
    if GlobalStateGuard is None:
        return frozenset()
    return frozenset(json.loads(GlobalStateGuard().__getstate__()))


# name -> (module, attribute or None for the module itself): imported on first use.
_LAZY = {
    "counters": ("torch._dynamo.utils", "counters"),
    "GuardManagerType": ("torch._dynamo.guards", "GuardManagerType"),
    "OutputGraph": ("torch._dynamo.output_graph", "OutputGraph"),
    "ConstantSource": ("torch._dynamo.source", "ConstantSource"),
    "cache_entries": ("torch._dynamo.eval_frame", "_debug_get_cache_entry_list"),
    "reset": ("torch._dynamo", "reset"),
}


__getattr__ = lazy(__name__, _LAZY)


# On the first entry into any ``torch.compile``d code in a process, Dynamo wraps
# ``nn.Module.__init__`` and ``__setstate__`` (to tag modules made while it runs) and puts
# ``torch.fx.Tracer.trace`` (with ``torch.jit.trace``) behind its ``disable``, for good.
_TAGGING = "install_generation_tagging_init.<locals>."


def unwrapped_setup(value):
    """``value`` without Dynamo's one-time wrapping of torch's own methods (above), if any."""
    if getattr(value, "__qualname__", "").startswith(_TAGGING) and value.__closure__:
        value = value.__closure__[0].cell_contents  # the method it wraps
    if getattr(value, "_torchdynamo_disable", False):
        value = value._torchdynamo_orig_callable
    return value


__all__ = ["AUTOCAST_FIELDS", "CONFIG_MODULES", "GLOBAL_STATE_FIELDS", "GlobalStateGuard",
           "RootGuardManager", "TensorGuards", "disable", "eval_frame_callback",
           "global_state_fields", "unwrapped_setup", *_LAZY]
